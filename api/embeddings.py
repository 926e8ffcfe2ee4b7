"""POST /v1/embeddings: OpenAI's embeddings API over the bundled all-MiniLM-L6-v2 (384 dimensions),
for retrieval: Open WebUI's and LangChain's OpenAI embedding clients, the `openai` SDK.

The vectors are sentence-transformers' for that model: the mean of the last hidden states over
[CLS], the text and [SEP], L2-normalised, each input read up to 256 tokens (its max_seq_length;
longer inputs are cut there, or refused with `embeddings.truncate = false`). The encoder is the
safety gate's (gateway/safety/embedder.py) without the gate's fine-tuning, loaded on the first
request. `input` is a string, an array of strings, or token ids of the model's own vocabulary
(one array, or an array of arrays); `encoding_format` "float" or "base64" (the `openai` SDK asks
for base64: little-endian float32 bytes).

A request takes one request from the caller's per-minute bucket before its body is read, then
its tokens (those the encoder reads, [CLS] and [SEP] included) from the token buckets, and is
billed in the usage ledger under the embeddings model. The encoder runs where the safety
classifier runs: between the native CPU engine's steps on its thread (engine/torch_threads), at
most _TURN_TOKENS tokens a turn, so a large request does not stall running streams for long.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import structlog
from aiohttp import web

from api.chat import json_dumps, read_json
from api.connections import reads_body_itself
from api.errors import bad_request, not_found, overloaded
from api.fields import kind_of
from api.state import PRINCIPAL, REQUEST_ID, STATE
from engine.torch_threads import pool_or_side_executor, side_executor
from engine.types import FinishReason
from gateway.errors import OverQuota
from settings import EmbeddingsConfig
from store import money
from store.types import RequestRecord, RequestStatus, StoreUnavailable

if TYPE_CHECKING:
    from gateway.safety.embedder import MiniLmEmbedder

log = structlog.get_logger(__name__)

MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length in sentence-transformers, [CLS] and [SEP] included
DIMENSIONS = 384
_TURN_TOKENS = 512  # tokens a turn between engine steps: ~65 ms in float32 on the 2-core AVX-512 VM
_HEAD_CHARS = 128 * MAX_TOKENS  # characters of a text tokenized: more than its first 256 tokens can span
_KNOWN = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool
    truncate: bool = True  # False: an input past MAX_TOKENS is a 400 whatever embeddings.truncate says


@dataclass(frozen=True, slots=True)
class Embedded:
    """One request's vectors, as billed: what each API renders in its own shape."""

    request: EmbeddingsRequest
    vectors: np.ndarray  # [num_inputs, DIMENSIONS]
    num_tokens: int
    total_s: float
    headers: dict[str, str]  # the caller's rate-limit headers


ParseEmbeddings = Callable[[object, EmbeddingsConfig], EmbeddingsRequest]


def parse_request(raw: object, cfg: EmbeddingsConfig) -> EmbeddingsRequest:
    if not isinstance(raw, dict):
        raise bad_request(f"The request body must be a JSON object, got {kind_of(raw)}.", param=None)
    for key in raw:
        if key not in _KNOWN:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a model name string.", param="model")
    fmt = raw.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}.", param="encoding_format")
    dimensions = raw.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions != DIMENSIONS):
        raise bad_request(
            f"'dimensions' can only be {DIMENSIONS} for {cfg.model}: its vectors cannot be shortened.",
            param="dimensions",
        )
    if raw.get("user") is not None and not isinstance(raw["user"], str):
        raise bad_request("'user' must be a string.", param="user")
    return EmbeddingsRequest(model, _inputs(raw.get("input"), cfg.max_inputs), fmt == "base64")


def _inputs(value: object, max_inputs: int) -> tuple[str | tuple[int, ...], ...]:
    """A string, an array of strings, an array of token ids, or an array of such arrays."""
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, list) and value and all(type(t) is int for t in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise bad_request(
            "'input' must be a non-empty string, an array of strings, or an array of token ids (or of such arrays).",
            param="input",
        )
    if len(items) > max_inputs:
        raise bad_request(f"'input' has {len(items)} items; at most {max_inputs} are allowed.", param="input")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            out.append(item)
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            out.append(tuple(item))
        else:
            got = "an empty string" if item == "" else "an empty array" if item == [] else kind_of(item)
            raise bad_request(
                f"'input[{i}]' must be a non-empty string or a non-empty array of token ids, got {got}.",
                param="input",
            )
    return tuple(out)


def _check_num_chars(req: EmbeddingsRequest, max_chars: int) -> None:
    """The inputs' characters (what is read of each) against server.max_prompt_chars, before any is
    tokenized: 512 inputs of 32,000 characters cost 8 s of CPU before the token bucket refused them."""
    num_chars = sum(min(len(item), _HEAD_CHARS) if isinstance(item, str) else len(item) for item in req.inputs)
    if num_chars > max_chars:
        raise bad_request(
            f"The inputs hold {num_chars} characters (token ids counted as one each); the limit is {max_chars} "
            "(server.max_prompt_chars). Send them in several requests.",
            param="input",
        )


class EmbeddingsService:
    """The encoder (loaded on first use) and how one request's texts are encoded."""

    def __init__(self, cfg: EmbeddingsConfig, kernel_isa: str):
        self.cfg = cfg
        self._kernel_isa = kernel_isa
        self._embedder: MiniLmEmbedder | None = None
        self._loading = asyncio.Lock()

    async def embedder(self) -> MiniLmEmbedder:
        async with self._loading:
            if self._embedder is None:
                from gateway.safety.embedder import MiniLmEmbedder

                def load() -> MiniLmEmbedder:
                    return MiniLmEmbedder(dtype=self.cfg.dtype, max_tokens=MAX_TOKENS, kernel_isa=self._kernel_isa)

                self._embedder = await asyncio.get_running_loop().run_in_executor(side_executor(), load)
            return self._embedder

    def token_ids(
        self, embedder: MiniLmEmbedder, inputs: tuple[str | tuple[int, ...], ...], *, truncate: bool = True
    ) -> list[list[int]]:
        """Each input's ids without [CLS] and [SEP], cut to fit (or a 400 naming the input, when
        this request or embeddings.truncate says not to cut)."""
        body, vocab = MAX_TOKENS - 2, embedder.vocab_size
        out = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                # A wordpiece covers at most 100 characters (longer words are [UNK]): this head
                # holds every token the encoder could read, and more than enough to refuse.
                ids = embedder.token_ids(item[:_HEAD_CHARS])
            else:
                if not all(0 <= t < vocab for t in item):
                    raise bad_request(
                        f"'input[{i}]' has token ids outside {self.cfg.model}'s vocabulary (0 to {vocab - 1}).",
                        param="input",
                    )
                ids = list(item)
            if len(ids) > body and not (truncate and self.cfg.truncate):
                more = " or more" if isinstance(item, str) and len(item) > _HEAD_CHARS else ""
                raise bad_request(
                    f"'input[{i}]' has {len(ids) + 2}{more} tokens; {self.cfg.model} reads at most {MAX_TOKENS} "
                    "([CLS] and [SEP] included). Split it into shorter texts.",
                    param="input",
                    code="context_length_exceeded",
                )
            out.append(ids[:body])
        return out

    async def embed(self, embedder: MiniLmEmbedder, id_lists: list[list[int]]) -> np.ndarray:
        """[len(id_lists), 384], encoded in turns of at most _TURN_TOKENS tokens."""
        loop = asyncio.get_running_loop()
        parts, start = [], 0
        while start < len(id_lists):
            end, tokens = start, 0
            while end < len(id_lists) and (end == start or tokens + len(id_lists[end]) + 2 <= _TURN_TOKENS):
                tokens += len(id_lists[end]) + 2
                end += 1
            parts.append(
                await loop.run_in_executor(pool_or_side_executor(), embedder.sentence_embeddings, id_lists[start:end])
            )
            start = end
        return np.concatenate(parts)


async def embed_request(request: web.Request, parse: ParseEmbeddings) -> Embedded:
    """The embeddings path every API shares: limits, budget, `parse` (the body into a request),
    tokenize, encode, bill in the usage ledger."""
    state = request.app[STATE]
    service = state.embeddings
    if service is None:
        raise not_found("Embeddings are not served here (embeddings.enabled is false).", code="model_not_found")
    if state.draining:
        raise overloaded("The server is shutting down.", retry_after_s=5, code="server_shutting_down")
    arrival, created_at = time.monotonic(), time.time()
    principal = request[PRINCIPAL]
    caller = state.caller(principal)
    limiter = state.admission.limiter
    # One request from the per-minute bucket before the body is read; its tokens once counted.
    reservation = limiter.acquire(caller.key, caller.tier_name, caller.tier, 0, caller.overrides)
    num_tokens_used = 0
    try:
        if await state.over_budget(principal):  # no cheaper embeddings model to fall back to
            raise OverQuota("You exceeded your current budget; check your plan and billing details.")
        req = parse(await read_json(request), service.cfg)
        _check_num_chars(req, state.settings.server.max_prompt_chars)
        if req.model != service.cfg.model:
            raise not_found(
                f"The model '{req.model}' does not exist or you do not have access to it "
                f"(embeddings: '{service.cfg.model}').",
                code="model_not_found",
                param="model",
            )
        if not state.store.is_writable:
            raise overloaded(
                "The usage ledger cannot be written; try again later.", retry_after_s=30, code="store_unavailable"
            )
        embedder = await service.embedder()
        loop = asyncio.get_running_loop()  # a megabyte of text takes tens of ms to tokenize: off the loop
        tokenize = functools.partial(service.token_ids, embedder, req.inputs, truncate=req.truncate)
        id_lists = await loop.run_in_executor(side_executor(), tokenize)
        num_tokens = sum(len(ids) + 2 for ids in id_lists)
        limiter.top_up(reservation, num_tokens)  # 429 when the token buckets cannot take them
        vectors = await service.embed(embedder, id_lists)
        num_tokens_used = num_tokens
    finally:
        limiter.settle(reservation, num_tokens_used)
    total_s = time.monotonic() - arrival
    record = RequestRecord(
        request_id=request[REQUEST_ID],
        org_id=principal.org.id,
        key_id=principal.key_id,
        model=req.model,
        tier=caller.tier_name,
        status=RequestStatus.FINISHED,
        prompt_tokens=num_tokens_used,
        cached_tokens=0,
        completion_tokens=0,
        cost_usd=float(money.cost_usd(((num_tokens_used, service.cfg.price_input_per_mtok),))),
        queue_ms=None,
        ttft_ms=None,
        total_ms=round(total_s * 1000.0, 3),
        created_at=created_at,
        finished_at=time.time(),
    )
    try:
        await state.record(None, record, FinishReason.STOP)
    except StoreUnavailable:
        raise overloaded(
            "The usage ledger cannot be written; try again later.", retry_after_s=30, code="store_unavailable"
        ) from None
    return Embedded(req, vectors, num_tokens_used, total_s, state.limit_headers(caller))


@reads_body_itself
async def create_embeddings(request: web.Request) -> web.Response:
    done = await embed_request(request, parse_request)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, done.request.base64)}
        for i, v in enumerate(done.vectors)
    ]
    usage = {"prompt_tokens": done.num_tokens, "total_tokens": done.num_tokens}
    body = {"object": "list", "data": data, "model": done.request.model, "usage": usage}
    return web.json_response(body, dumps=json_dumps, headers=done.headers)


def _encoded(vector: np.ndarray, as_base64: bool) -> list[float] | str:
    if as_base64:
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", create_embeddings)
