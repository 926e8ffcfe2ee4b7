"""POST /v1/completions: OpenAI's legacy text completion, as vLLM, llama.cpp and Ollama serve it.

The prompt (text or token ids) goes to the model as it is, with no chat template, and the model
continues it: what evaluation harnesses, code-completion plugins and base models use. It takes
the chat completions' request path (`chat.serve_job`: admission, routing, budget, safety gate,
priority queue, generation, billing in the usage ledger) with a `ChatRequest` whose
`raw_prompt` is set; only parsing and rendering differ. Nothing is stored as a conversation.
A model relayed to another server (backend "openai") gets a text prompt at that server's
/completions (engine/upstream/wire.py); token ids only go to models served here.
`echo` with `logprobs` gives the prompt's own tokens and log-probabilities first (the native
engine computes them, skipping the prefix cache for that request): what evaluation harnesses
such as lm-evaluation-harness score. Not supported, each a 400 naming the field: several
prompts in one request, `suffix`, `best_of` other than `n`, `echo` with `logprobs` streamed.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from api import chat_bodies, protocol
from api.chat import Outlet, admit_and_serve, json_dumps, record_refusal, usage_of
from api.connections import reads_body_itself
from api.errors import bad_request
from api.fields import kind_of
from api.finish import STATUS, finish_job, generate_unary, stream_job
from api.generation import generate_choices
from api.job import Job
from api.sse import SSEWriter
from api.state import AppState
from api.waiting import LazyStream, wait_admitted
from engine.tokenizer import Tokenizer
from engine.types import FinishReason, TokenLogprob, TokenText
from engine.upstream.counting import Counter
from gateway.admission import Pass
from settings import ServerConfig

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint (vLLM's too)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI allows 5; vLLM and this engine go to 20)

# Fields passed on to the chat parser as they are (validated there, with the same messages).
_SHARED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "user",
    "logit_bias",
    "response_format",
)
_OWN = ("prompt", "max_tokens", "logprobs", "echo", "suffix", "best_of")


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    chat: protocol.ChatRequest  # raw_prompt set; messages: the prompt's text (token ids: decoded later)
    echo: bool  # the answer starts with the prompt's text


def parse_completion_request(raw: Any, *, max_prompt_chars: int, max_n: int) -> CompletionRequest:
    """Validate a decoded JSON body; raise ApiError(400) naming the field on any problem."""
    if not isinstance(raw, dict):
        raise bad_request(f"The request body must be a JSON object, got {kind_of(raw)}.", param=None)
    for key in raw:
        if key not in _SHARED and key not in _OWN:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    if raw.get("suffix") not in (None, ""):
        raise bad_request("'suffix' (fill in the middle) is not supported by this server.", param="suffix")
    prompt = _prompt(raw.get("prompt"), max_prompt_chars)
    logprobs = _logprobs(raw.get("logprobs"))
    echo = raw.get("echo", False)
    if not isinstance(echo, bool) and echo is not None:
        raise bad_request(f"'echo' must be a boolean, got {kind_of(echo)}.", param="echo")
    if echo and logprobs is not None and raw.get("stream"):
        raise bad_request(
            "'echo' with 'logprobs' is answered unstreamed only on this server.",
            param="stream",
            code="unsupported_value",
        )
    max_tokens = raw.get("max_tokens")
    chat_raw: dict[str, Any] = {key: raw[key] for key in _SHARED if key in raw}
    chat_raw["max_tokens"] = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    chat_raw["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}]
    if logprobs is not None:
        chat_raw.update(logprobs=True, top_logprobs=logprobs)
    chat = protocol.parse_chat_request(chat_raw, max_messages=1, max_prompt_chars=max_prompt_chars, max_n=max_n)
    best_of = raw.get("best_of")
    if best_of is not None and best_of != chat.n:
        raise bad_request(
            f"'best_of' must equal 'n' ({chat.n}) on this server, got {best_of!r}.",
            param="best_of",
            code="unsupported_value",
        )
    prompt_logprobs = logprobs if echo else None  # what evaluation harnesses score (lm-eval's loglikelihood)
    return CompletionRequest(replace(chat, raw_prompt=prompt, prompt_logprobs=prompt_logprobs), bool(echo))


def _prompt(value: Any, max_chars: int) -> str | tuple[int, ...]:
    """Text, or token ids; a one-element array of either is the same prompt. `max_chars`
    (server.max_prompt_chars) caps the text's characters and the number of token ids."""
    if value is None:
        raise bad_request("'prompt' is required.", param="prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if len(value) > max_chars:
            raise bad_request(
                f"'prompt' has {len(value)} characters; this server takes at most {max_chars}.",
                param="prompt",
                code="string_above_max_length",
            )
        return value
    if isinstance(value, list) and len(value) > max_chars:  # before any entry is looked at
        raise bad_request(
            f"'prompt' has {len(value)} entries; this server takes at most {max_chars} token ids.",
            param="prompt",
            code="array_above_max_length",
        )
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise bad_request(
            f"'prompt' holds {len(value)} prompts; this server takes one per request (send them as separate requests).",
            param="prompt",
            code="unsupported_value",
        )
    raise bad_request(f"'prompt' must be a string or an array of token ids, got {kind_of(value)}.", param="prompt")


def _logprobs(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}.", param="logprobs")
    return value


@reads_body_itself
async def completions(request: web.Request) -> web.StreamResponse:
    def parse(raw: object, cfg: ServerConfig) -> tuple[protocol.ChatRequest, Outlet]:
        req = parse_completion_request(raw, max_prompt_chars=cfg.max_prompt_chars, max_n=cfg.max_n)
        return req.chat, Outlet(serve=functools.partial(_serve, req.echo), refuse=_refuse)

    return await admit_and_serve(request, parse)


class TextChoice:
    """One choice as text: the filtered text deltas, and OpenAI's legacy logprobs for the tokens
    behind them (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

    def __init__(self, tokenizer: Tokenizer | Counter, wants_logprobs: bool, prefix: str):
        self._tokenizer = tokenizer
        self._wants_logprobs = wants_logprobs
        self._offset = len(prefix)  # text_offset counts from the start of the choice's text
        self.parts: list[str] = [prefix] if prefix else []
        self.logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def feed(self, text: str, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        """This piece as a streamed choice's fields: its text and its tokens' logprobs."""
        if text:
            self.parts.append(text)
        rendered = self._render(logprobs) if self._wants_logprobs else None
        return {"text": text, "logprobs": rendered}

    def _render(self, logprobs: tuple[TokenLogprob, ...]) -> dict[str, list]:
        piece, self._offset = self._piece([lp.token for lp in logprobs], logprobs, self._offset)
        for key, values in piece.items():
            self.logprobs[key].extend(values)
        return piece

    def _piece(
        self, tokens: Sequence[int | TokenText], logprobs: Sequence[TokenLogprob | None], offset: int
    ) -> tuple[dict[str, list], int]:
        """These tokens in the legacy shape, their text offsets from `offset` (a None logprob, the
        prompt's first token's, is null as OpenAI's); and the offset after them."""
        piece: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for ref, lp in zip(tokens, logprobs, strict=True):
            token = self._text(ref)
            piece["tokens"].append(token)
            piece["token_logprobs"].append(None if lp is None else max(lp.logprob, -9999.0))  # JSON has no -inf
            piece["top_logprobs"].append(
                None if lp is None else {self._text(t): max(v, -9999.0) for t, v in lp.top_logprobs}
            )
            piece["text_offset"].append(offset)
            offset += len(token)
        return piece, offset

    def _text(self, token: int | TokenText) -> str:
        return (
            token.text if isinstance(token, TokenText) else self._tokenizer.decode([token], skip_special_tokens=False)
        )

    def prepend_prompt(self, logprobs: tuple[TokenLogprob | None, ...], token_ids: tuple[int, ...]) -> None:
        """Echo with logprobs: the prompt's tokens before the answer's, each with its logprob given
        the ones before it."""
        piece, _ = self._piece(token_ids, logprobs, 0)
        for key, values in piece.items():
            self.logprobs[key][:0] = values

    def close(self) -> None:
        """Nothing is held back (no tool calls or reasoning to parse in a raw completion)."""

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def logprobs_obj(self) -> dict[str, list] | None:
        return self.logprobs if self._wants_logprobs else None


def completion_id(job: Job) -> str:
    return "cmpl-" + job.request_id.removeprefix("req_")


def _body(job: Job, created: int, choices: list[dict], usage: dict | None) -> dict:
    body: dict[str, Any] = {
        "id": completion_id(job),
        "object": "text_completion",
        "created": created,
        "model": job.model.name,
        "system_fingerprint": None,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def _choice(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _echo_text(job: Job, echo: bool) -> str:
    return job.context[0].content if echo else ""


async def _serve(echo: bool, request: web.Request, state: AppState, job: Job, grant: Pass) -> web.StreamResponse:
    choices = [
        TextChoice(job.model.tokenizer, job.chat.logprobs is not None, _echo_text(job, echo)) for _ in range(job.chat.n)
    ]
    if job.chat.stream:
        return await _serve_stream(request, state, job, grant, choices)
    finishes = await generate_unary(request, state, job, grant, choices)
    if job.prompt_logprobs:  # echo with logprobs: the prompt's tokens come first
        for choice in choices:
            choice.prepend_prompt(job.prompt_logprobs, job.gen.prompt_token_ids)
    body = _body(
        job,
        chat_bodies.now_s(),
        [_choice(i, c.text, c.logprobs_obj(), f.value) for i, (c, f) in enumerate(zip(choices, finishes, strict=True))],
        usage_of(state, job),
    )
    return web.json_response(body, headers=state.response_headers(job), dumps=json_dumps)


async def _serve_stream(
    request: web.Request, state: AppState, job: Job, grant: Pass, choices: list[TextChoice]
) -> web.StreamResponse:
    stream = LazyStream(request, lambda: state.response_headers(job))
    created = chat_bodies.now_s()
    include_usage = job.chat.include_usage
    writer: SSEWriter | None = None  # opened once admitted

    async def send(index: int, text: str, logprobs: dict | None, finish: str | None = None) -> None:
        assert writer is not None  # tokens flow only once admitted
        usage = usage_of(state, job) if job.chat.continuous_usage else None
        body = _body(job, created, [_choice(index, text, logprobs, finish)], usage)
        if include_usage and usage is None:
            body["usage"] = None  # as chat: null on every chunk but the last
        await writer.data(body)

    def emitter(index: int) -> Callable[[str, tuple[TokenLogprob, ...]], Awaitable[None]]:
        async def emit(text: str, logprobs: tuple[TokenLogprob, ...]) -> None:
            piece = choices[index].feed(text, logprobs)
            await send(index, piece["text"], piece["logprobs"])

        return emit

    async def run() -> None:
        nonlocal writer
        await wait_admitted(state, grant, job, stream.comment)
        writer = await stream.open()
        for i, choice in enumerate(choices):
            if choice.text:  # echo: the prompt comes first
                await send(i, choice.text, None)
        finishes = await generate_choices(state, job, [emitter(i) for i in range(len(choices))], writer.comment)
        await finish_job(state, job, STATUS[finishes[0]], finishes[0])  # durable before the client sees the end
        for i, finish in enumerate(finishes):
            await send(i, "", None, finish.value)
        if include_usage:
            await writer.data(_body(job, created, [], usage_of(state, job)))
        await writer.done()

    return await stream_job(request, state, job, grant, stream, run)


async def _refuse(request: web.Request, state: AppState, job: Job, verdict) -> web.StreamResponse:
    """A prompt the safety gate blocked: the refusal as the completion's text, finish_reason
    content_filter (a 400 in the gate's error mode), as chat completions do."""
    refusal = await record_refusal(state, job, verdict)
    usage = chat_bodies.usage_dict(0, 0, 0, 0.0)
    created = chat_bodies.now_s()
    finish = FinishReason.CONTENT_FILTER.value
    indices = range(job.chat.n)  # every choice asked for gets the refusal
    if not job.chat.stream:
        body = _body(job, created, [_choice(i, refusal, None, finish) for i in indices], usage)
        return web.json_response(body, headers=state.response_headers(job), dumps=json_dumps)
    writer = await SSEWriter.open(request, state.response_headers(job))
    for i in indices:
        await writer.data(_body(job, created, [_choice(i, refusal, None, None)], None))
        await writer.data(_body(job, created, [_choice(i, "", None, finish)], None))
    if job.chat.include_usage:
        await writer.data(_body(job, created, [], usage))
    await writer.done()
    return writer.response


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
