"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, for Claude Code and
the `anthropic` SDK on the models this server runs.

The body becomes the same validated chat request as chat completions (api/messages_request.py)
and takes their request path (`chat.serve_job`: limits, routing, budget, safety gate, queue,
generation, usage ledger); only parsing and rendering differ. The answer is a `message` with
`thinking`, `text` and `tool_use` content blocks; streamed, the named events Anthropic's SDK reads
(`message_start`, `content_block_start`/`_delta`/`_stop`, `message_delta`, `message_stop`, with
`error` events on failure). Errors use Anthropic's envelope (`api/app.py`). A key may come as
`x-api-key` or as `Authorization: Bearer` (api/security.py).

A reasoning model's thinking comes back as a `thinking` block (with an empty `signature`:
nothing is signed here). `stop_reason` says `stop_sequence`, and `stop_sequence` which one, when
a stop sequence ended the answer (a relayed model: when its server says which, as vLLM does).
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
from aiohttp import web

from api import protocol
from api.answer import Answer
from api.chat import Outlet, admit_and_serve, json_dumps, read_json, record_refusal
from api.connections import reads_body_itself
from api.errors import ApiError
from api.finish import STATUS, finish_job, generate_unary, stream_job
from api.generation import generate_choices, make_answer
from api.job import Job
from api.messages_request import parse_messages_request
from api.prompt import prompt_tools
from api.sse import SSEWriter
from api.state import STATE, AppState
from api.token_count import charge_one_request, count_prompt, model_to_count_for, read_files
from api.tools import ToolCall
from api.waiting import LazyStream, wait_admitted
from engine.types import FinishReason, TokenLogprob
from gateway.admission import Pass
from settings import ServerConfig

# Our finish reasons as Anthropic's stop_reason (tool calls: "tool_use", set where they are seen).
_STOP_REASON = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.CONTENT_FILTER: "refusal",
    FinishReason.ABORT: "end_turn",
}

# Anthropic's error types by HTTP status (their API reference, "Errors").
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(error: ApiError) -> dict:
    """An ApiError in Anthropic's envelope: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = error.message if error.param is None else f"{error.message} (param: {error.param})"
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# -- the answer ---------------------------------------------------------------------------


def message_id(job: Job) -> str:
    return "msg_" + job.request_id.removeprefix("req_")


def _usage(job: Job, *, billed: bool = True) -> dict[str, int]:
    """Anthropic counts cache reads apart from input_tokens."""
    cached = job.num_cached_tokens if billed else 0
    return {
        "input_tokens": (job.num_prompt_tokens - cached) if billed else 0,
        "output_tokens": job.num_completion_tokens if billed else 0,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_` prefix on a call id we made; clients send it back as it is."""
    return "toolu_" + call_id.removeprefix("call_")


def _tool_block(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        arguments = None
    return {
        "type": "tool_use",
        "id": tool_use_id(call.id),
        "name": call.name,
        "input": arguments if isinstance(arguments, dict) else {},
    }


def _stop(job: Job, answer: Answer, finish: FinishReason) -> dict[str, Any]:
    """Anthropic's `stop_reason` and `stop_sequence` (the one that ended the answer, if one did)."""
    if answer.tool_calls and finish is FinishReason.STOP:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish is FinishReason.STOP and job.stop_str is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": job.stop_str}
    return {"stop_reason": _STOP_REASON[finish], "stop_sequence": None}


def _message(job: Job, content: list[dict], stop: dict[str, Any], usage: dict) -> dict[str, Any]:
    return {
        "id": message_id(job),
        "type": "message",
        "role": "assistant",
        "model": job.model.name,
        "content": content,
        **stop,
        "usage": usage,
    }


class AnthropicSSE(SSEWriter):
    """Anthropic's SSE: each frame named by its payload's type (`event: message_start`), errors
    as `error` events, and no `[DONE]` at the end."""

    async def data(self, payload: dict) -> None:
        if "type" not in payload and "error" in payload:  # the shared failure path's OpenAI-shaped error
            err = payload["error"]
            payload = {"type": "error", "error": {"type": _error_type(err), "message": err.get("message", "")}}
        kind = str(payload.get("type", "message"))
        await self._write(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n")

    async def done(self) -> None:
        await self.end()


def _error_type(err: dict) -> str:
    code, kind = err.get("code"), err.get("type")
    if code in ("server_shutting_down", "store_unavailable", "model_unavailable"):
        return "overloaded_error"
    return "invalid_request_error" if kind == "invalid_request_error" else "api_error"


class _Blocks:
    """The streamed content blocks of one answer: text opens a text block, each tool call is a
    tool_use block of its own (its whole input in one input_json_delta)."""

    def __init__(self, writer: SSEWriter):
        self._writer = writer
        self._index = itertools.count()
        self._open: tuple[int, str] | None = None  # (index, "text") while a text block is open

    async def feed(self, deltas: list[dict]) -> None:
        for d in deltas:
            delta = d["delta"]
            if delta.get("reasoning_content"):
                await self._piece("thinking", delta["reasoning_content"])
            if delta.get("content"):
                await self._piece("text", delta["content"])
            for call in delta.get("tool_calls") or ():
                await self._tool(call)

    async def _piece(self, kind: str, text: str) -> None:
        """Text or thinking into the open block of its kind (a new block when the kind changes)."""
        if self._open is not None and self._open[1] != kind:
            await self.close()
        if self._open is None:
            self._open = (next(self._index), kind)
            block = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            await self._writer.data({"type": "content_block_start", "index": self._open[0], "content_block": block})
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        await self._writer.data({"type": "content_block_delta", "index": self._open[0], "delta": delta})

    async def _tool(self, call: dict) -> None:
        await self.close()
        index = next(self._index)
        fn = call["function"]
        block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"], "input": {}}
        await self._writer.data({"type": "content_block_start", "index": index, "content_block": block})
        delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
        await self._writer.data({"type": "content_block_delta", "index": index, "delta": delta})
        await self._writer.data({"type": "content_block_stop", "index": index})

    async def close(self) -> None:
        if self._open is not None:
            if self._open[1] == "thinking":  # no signature: this server signs nothing
                delta = {"type": "signature_delta", "signature": ""}
                await self._writer.data({"type": "content_block_delta", "index": self._open[0], "delta": delta})
            await self._writer.data({"type": "content_block_stop", "index": self._open[0]})
            self._open = None


async def _serve(request: web.Request, state: AppState, job: Job, grant: Pass) -> web.StreamResponse:
    answer = make_answer(job)
    if job.chat.stream:
        return await _serve_stream(request, state, job, grant, answer)
    (finish,) = await generate_unary(request, state, job, grant, [answer])
    content: list[dict] = []
    thinking = "".join(answer.reasoning_parts)
    if thinking:
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    text = "".join(answer.content_parts)
    if text:
        content.append({"type": "text", "text": text})
    content.extend(_tool_block(call) for call in answer.tool_calls)
    body = _message(job, content, _stop(job, answer, finish), _usage(job))
    return web.json_response(body, headers=state.response_headers(job), dumps=json_dumps)


async def _serve_stream(
    request: web.Request, state: AppState, job: Job, grant: Pass, answer: Answer
) -> web.StreamResponse:
    stream = LazyStream(request, lambda: state.response_headers(job), AnthropicSSE)
    blocks: _Blocks | None = None

    async def emit(text: str, logprobs: tuple[TokenLogprob, ...]) -> None:
        assert blocks is not None  # tokens flow only once the stream is open
        await blocks.feed(answer.feed(text, logprobs))

    async def run() -> None:
        nonlocal blocks
        await wait_admitted(state, grant, job, stream.comment)
        writer = await stream.open()
        blocks = _Blocks(writer)
        start_usage = {**_usage(job), "output_tokens": 0}
        start = {"stop_reason": None, "stop_sequence": None}
        await writer.data({"type": "message_start", "message": _message(job, [], start, start_usage)})
        (finish,) = await generate_choices(state, job, [emit], writer.comment)
        await blocks.feed(answer.close())
        await blocks.close()
        await finish_job(state, job, STATUS[finish], finish)  # durable before the client sees the end
        delta = _stop(job, answer, finish)
        await writer.data({"type": "message_delta", "delta": delta, "usage": _usage(job)})
        await writer.data({"type": "message_stop"})
        await writer.done()

    return await stream_job(request, state, job, grant, stream, run)


async def _refuse(request: web.Request, state: AppState, job: Job, verdict) -> web.StreamResponse:
    """A prompt the safety gate blocked: the refusal as the answer's text, stop_reason refusal
    (a 400 in the gate's error mode), as chat completions do."""
    refusal = await record_refusal(state, job, verdict)
    usage = _usage(job, billed=False)
    content = [{"type": "text", "text": refusal}]
    if not job.chat.stream:
        body = _message(job, content, {"stop_reason": "refusal", "stop_sequence": None}, usage)
        return web.json_response(body, headers=state.response_headers(job), dumps=json_dumps)
    writer = await AnthropicSSE.open(request, state.response_headers(job))
    start = {"stop_reason": None, "stop_sequence": None}
    await writer.data({"type": "message_start", "message": _message(job, [], start, usage)})
    await writer.data({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    delta = {"type": "text_delta", "text": refusal}
    await writer.data({"type": "content_block_delta", "index": 0, "delta": delta})
    await writer.data({"type": "content_block_stop", "index": 0})
    await writer.data(
        {"type": "message_delta", "delta": {"stop_reason": "refusal", "stop_sequence": None}, "usage": usage}
    )
    await writer.data({"type": "message_stop"})
    await writer.done()
    return writer.response


# -- the routes ---------------------------------------------------------------------------


@reads_body_itself
async def create_message(request: web.Request) -> web.StreamResponse:
    def parse(raw: object, cfg: ServerConfig) -> tuple[protocol.ChatRequest, Outlet]:
        chat = parse_messages_request(raw, max_messages=cfg.max_messages, max_prompt_chars=cfg.max_prompt_chars)
        return chat, Outlet(serve=_serve, refuse=_refuse)

    return await admit_and_serve(request, parse)


async def count_tokens(request: web.Request) -> web.Response:
    """{"input_tokens": N}: the request's prompt as this server renders it for the model (no
    generation, nothing billed; one request against the caller's per-minute limit)."""
    headers = charge_one_request(request)
    cfg = request.app[STATE].settings.server
    chat = parse_messages_request(
        await read_json(request), max_messages=cfg.max_messages, max_prompt_chars=cfg.max_prompt_chars, count_only=True
    )
    model = model_to_count_for(request, chat.model)
    messages = await read_files(request, model, chat.messages)
    num_tokens = await count_prompt(
        model, messages, prompt_tools(chat), chat.chat_template_kwargs, chat.continue_final_message
    )
    return web.json_response({"input_tokens": num_tokens}, dumps=json_dumps, headers=headers)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
