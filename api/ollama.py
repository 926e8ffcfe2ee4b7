"""POST /api/chat and /api/generate: Ollama's native API, for the tools that speak only it (Home
Assistant's Ollama integration, editor and Obsidian plugins, the `ollama` Python library).

The body becomes the same validated chat request as chat completions (api/ollama_request.py) and
takes their request path (`chat.admit_and_serve`: limits, routing, budget, safety gate, queue,
generation, usage ledger); only parsing and rendering differ. Streamed (Ollama's default) the
answer is newline-delimited JSON (`application/x-ndjson`): one object per piece with `done:
false`, then one with `done: true`, `done_reason` and the counts and durations (nanoseconds);
not streamed, that last object holds the whole answer. While a request waits in the queue or
its prompt is read, an empty piece every heartbeat keeps proxies from closing the stream.
Errors are Ollama's `{"error": "..."}` (api/app.py), with the status and Retry-After of the
OpenAI path; after the stream has opened, one `{"error": ...}` line ends it.

`prompt_eval_count` is every prompt token (prefix-cache hits included), as the usage ledger
bills them; `load_duration` is 0 (models stay loaded as configured); the model name answers
repeat the client's (`tiny:latest` is `tiny`). The load call (nothing to generate) loads a
model loaded on demand (`idle_unload_s`) now; the unload call (`keep_alive` 0 too) unloads it; a
model that stays loaded is not, and its answer says so ("load", not "unload").
"""

from __future__ import annotations

import functools
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

from api import protocol
from api.answer import Answer
from api.chat import Outlet, admit_and_serve, json_dumps, record_refusal
from api.connections import reads_body_itself
from api.errors import ApiError, not_found
from api.finish import STATUS, engine_api_error, finish_job, generate_unary, stream_job
from api.generation import generate_choices, make_answer
from api.job import Job
from api.ollama_request import Endpoint, LoadOnly, OllamaRequest, parse_chat, parse_generate, resolve_model
from api.sse import SSEWriter
from api.state import PRINCIPAL, STATE, AppState
from api.waiting import LazyStream, wait_admitted
from engine.types import EngineError, FinishReason, TokenLogprob
from gateway.admission import Pass
from settings import ServerConfig

NDJSON = "application/x-ndjson"
# Our finish reasons as Ollama's done_reason (it has no word for a filtered answer).
_DONE_REASON = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTENT_FILTER: "content_filter",
    FinishReason.ABORT: "stop",
}


def error_body(error: ApiError) -> dict[str, str]:
    """An ApiError in Ollama's shape: {"error": "message"} (the field it names, if any, in it)."""
    return {"error": error.message if error.param is None else f"{error.message} (param: {error.param})"}


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class NDJSONWriter(SSEWriter):
    """One JSON object per line; an error from the shared failure path as Ollama's `{"error"}`.
    NDJSON has no comments: heartbeats are empty pieces, written by the caller."""

    @classmethod
    async def open(cls, request: web.Request, headers: dict[str, str]) -> SSEWriter:
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": NDJSON, "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
        if request.version < (1, 1):
            response.force_close()
        await response.prepare(request)
        return cls(response)

    async def data(self, payload: dict) -> None:
        err = payload.get("error")
        if isinstance(err, dict):  # the shared failure path's OpenAI-shaped error
            payload = {"error": err.get("message", "")}
        await self._write(orjson.dumps(payload) + b"\n")

    async def comment(self, text: str) -> None:
        return None

    async def done(self) -> None:
        await self.end()


# -- the answer ---------------------------------------------------------------------------


def _shown_model(req: OllamaRequest, job: Job) -> str:
    """The name the client gave, unless another model served it (a fallback)."""
    return req.model if req.chat.model == job.model.name else job.model.name


def _call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """A tool call in Ollama's shape: arguments as an object, not JSON text."""
    fn = call["function"]
    try:
        arguments = orjson.loads(fn["arguments"])
    except orjson.JSONDecodeError:
        arguments = None
    return {
        "id": call["id"],
        "function": {"index": index, "name": fn["name"], "arguments": arguments if isinstance(arguments, dict) else {}},
    }


def _piece(delta: dict[str, Any], logprobs: list | None) -> dict[str, Any]:
    """One answer delta (api/answer.py) as the fields of an Ollama piece."""
    piece: dict[str, Any] = {"content": delta.get("content") or ""}
    if delta.get("reasoning_content"):
        piece["thinking"] = delta["reasoning_content"]
    if delta.get("tool_calls"):
        piece["tool_calls"] = [_call(c, c["index"]) for c in delta["tool_calls"]]
    if logprobs is not None:
        piece["logprobs"] = logprobs
    return piece


def _body(req: OllamaRequest, job: Job, piece: dict[str, Any], done: bool) -> dict[str, Any]:
    """One object of the answer: the piece as `message` (/api/chat) or `response` (/api/generate)."""
    body: dict[str, Any] = {"model": _shown_model(req, job), "created_at": now_rfc3339()}
    if req.endpoint is Endpoint.CHAT:
        message: dict[str, Any] = {"role": "assistant", "content": piece.get("content", "")}
        for key in ("thinking", "tool_calls"):
            if piece.get(key):
                message[key] = piece[key]
        body["message"] = message
    else:
        body["response"] = piece.get("content", "")
        if piece.get("thinking"):
            body["thinking"] = piece["thinking"]
    if piece.get("logprobs"):
        body["logprobs"] = piece["logprobs"]
    body["done"] = done
    return body


def _ns(start: float | None, end: float | None) -> int:
    return 0 if start is None or end is None else max(0, int((end - start) * 1e9))


def _counts(job: Job, *, billed: bool = True) -> dict[str, int]:
    """Ollama's counts (as the ledger bills them) and durations in nanoseconds."""
    end = time.monotonic()
    first = job.first_token_s
    return {
        "total_duration": _ns(job.arrival_s, end),
        "load_duration": 0,
        "prompt_eval_count": job.num_prompt_tokens if billed else 0,
        "prompt_eval_duration": _ns(job.admitted_s, first),
        "eval_count": job.num_completion_tokens if billed else 0,
        "eval_duration": _ns(first, end if first is not None else None),
    }


def _final(req: OllamaRequest, job: Job, piece: dict[str, Any], done_reason: str, counts: dict) -> dict[str, Any]:
    return {**_body(req, job, piece, True), "done_reason": done_reason, **counts}


def _whole(answer: Answer) -> dict[str, Any]:
    """A unary answer's piece: all its text, thinking, tool calls and logprobs."""
    piece: dict[str, Any] = {
        "content": "".join(answer.content_parts),
        "thinking": "".join(answer.reasoning_parts),
        "tool_calls": [_call(c.as_dict(), i) for i, c in enumerate(answer.tool_calls)],
    }
    logprobs = answer.logprobs_obj()
    if logprobs is not None:
        piece["logprobs"] = logprobs["content"]
    return piece


async def _serve(
    req: OllamaRequest, request: web.Request, state: AppState, job: Job, grant: Pass
) -> web.StreamResponse:
    answer = make_answer(job)
    if job.chat.stream:
        return await _serve_stream(req, request, state, job, grant, answer)
    (finish,) = await generate_unary(request, state, job, grant, [answer])
    body = _final(req, job, _whole(answer), _DONE_REASON[finish], _counts(job))
    return web.json_response(body, headers=state.response_headers(job), dumps=json_dumps)


async def _serve_stream(
    req: OllamaRequest, request: web.Request, state: AppState, job: Job, grant: Pass, answer: Answer
) -> web.StreamResponse:
    stream = LazyStream(request, lambda: state.response_headers(job), NDJSONWriter)

    async def send(deltas: list[dict]) -> None:
        writer = await stream.open()
        for d in deltas:
            logprobs = d["logprobs"]["content"] if d.get("logprobs") else None
            await writer.data(_body(req, job, _piece(d["delta"], logprobs), False))

    async def heartbeat(_text: str) -> None:  # an empty piece: NDJSON has no comments
        await (await stream.open()).data(_body(req, job, {}, False))

    async def emit(text: str, logprobs: tuple[TokenLogprob, ...]) -> None:
        await send(answer.feed(text, logprobs))

    async def run() -> None:
        await wait_admitted(state, grant, job, heartbeat)
        writer = await stream.open()
        (finish,) = await generate_choices(state, job, [emit], heartbeat)
        await send(answer.close())
        await finish_job(state, job, STATUS[finish], finish)  # durable before the client sees the end
        await writer.data(_final(req, job, {}, _DONE_REASON[finish], _counts(job)))
        await writer.done()

    return await stream_job(request, state, job, grant, stream, run)


async def _refuse(req: OllamaRequest, request: web.Request, state: AppState, job: Job, verdict) -> web.StreamResponse:
    """A prompt the safety gate blocked: the refusal as the answer (nothing billed), done_reason
    content_filter; a 400 in the gate's error mode, as chat completions do."""
    refusal = await record_refusal(state, job, verdict)
    final = _final(req, job, {"content": refusal}, "content_filter", _counts(job, billed=False))
    if not job.chat.stream:
        return web.json_response(final, headers=state.response_headers(job), dumps=json_dumps)
    writer = await NDJSONWriter.open(request, state.response_headers(job))
    await writer.data(_body(req, job, {"content": refusal}, False))
    await writer.data(_final(req, job, {}, "content_filter", _counts(job, billed=False)))
    await writer.done()
    return writer.response


async def _load_answer(request: web.Request, load: LoadOnly) -> web.Response:
    """Ollama's "load the model" call: a model loaded on demand is loaded now (503 if it cannot
    be), one that stays loaded as configured is there already; 404 for a model the caller's tier
    cannot use. Its "unload" call (keep_alive 0): a model loaded on demand is unloaded (once the
    requests running on it end), done_reason "unload"; one that stays loaded as configured is
    not, and the answer says "load", as the load call's does."""
    state = request.app[STATE]
    tier_name, _ = state.tier_of(request[PRINCIPAL])
    names = state.admission.router.models_for_tier(tier_name)
    name = resolve_model(load.model, frozenset(names))
    if name not in names:
        raise not_found(f"model '{load.model}' not found (see /api/tags)", code="model_not_found", param="model")
    backend = state.models[name].backend
    # A model loaded on demand (idle_unload_s) has both; one that stays loaded has neither.
    load_now, unload_now = getattr(backend, "load", None), getattr(backend, "unload", None)
    done_reason = "load"
    if load_now is not None and unload_now is not None:
        try:
            await (unload_now() if load.is_unload else load_now())
        except EngineError as exc:  # it could not be loaded: 503, as a request would get
            raise engine_api_error(exc) from None
        done_reason = "unload" if load.is_unload else "load"
    body: dict[str, Any] = {"model": load.model, "created_at": now_rfc3339()}
    if load.endpoint is Endpoint.CHAT:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return web.json_response({**body, "done": True, "done_reason": done_reason}, dumps=json_dumps)


# -- the routes ---------------------------------------------------------------------------


async def _admit(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    known = frozenset(request.app[STATE].models)

    def parse(raw: object, cfg: ServerConfig) -> tuple[protocol.ChatRequest, Outlet]:
        if endpoint is Endpoint.CHAT:
            req = parse_chat(raw, known=known, max_messages=cfg.max_messages, max_prompt_chars=cfg.max_prompt_chars)
        else:
            req = parse_generate(raw, known=known, max_prompt_chars=cfg.max_prompt_chars)
        return req.chat, Outlet(serve=functools.partial(_serve, req), refuse=functools.partial(_refuse, req))

    try:
        return await admit_and_serve(request, parse)
    except LoadOnly as load:
        return await _load_answer(request, load)


@reads_body_itself
async def chat(request: web.Request) -> web.StreamResponse:
    return await _admit(request, Endpoint.CHAT)


@reads_body_itself
async def generate(request: web.Request) -> web.StreamResponse:
    return await _admit(request, Endpoint.GENERATE)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
