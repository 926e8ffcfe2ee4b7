"""POST /v1/chat/completions: the request path from the request's bytes to SSE or JSON.

Owns the order of the request path: the cheap refusals first (rate limits and the stream
cap, sized from the body's bytes), then validate, read the store, route, tokenize, screen and
place in the queue (`serve_job`, which the Responses API shares), then render the answer as
chat completion chunks or one JSON body. The generation itself is `api/generation.py`; how a
job ends (one ledger row and the conversation's messages before the client sees the end of its
answer, whatever fails) is `api/finish.py`. The admission `Pass` releases the bucket, stream
slot and queue ticket exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web

from api import attachments, chat_bodies, legacy_functions, protocol
from api.attachment_parts import AttachContext
from api.connections import read_body, reads_body_itself
from api.errors import ApiError, bad_request, overloaded
from api.files import BLOBS, TEXTS
from api.finish import STATUS, finish_job, generate_unary, shutting_down, stream_job
from api.generation import generate_choices, make_answer
from api.inflight import INFLIGHT
from api.job import Job, JobInputs, conversation_not_found
from api.parts import num_inline_chars
from api.security import is_ollama_path
from api.sse import SSEWriter
from api.state import PRINCIPAL, REQUEST_ID, SETTINGS, STATE, AppState
from api.waiting import LazyStream, wait_admitted
from engine.types import FinishReason, TokenLogprob
from gateway.admission import Pass
from settings import ServerConfig
from store.types import RequestStatus

_STRUCTURE_CONTAINERS = 100_000  # arrays and objects a body may hold beyond brackets in its text


def _takes_body_as_json(request: web.Request) -> bool:
    """JSON bodies come as application/json (or untyped). Ollama's documented examples and the
    scripts written from them send JSON with `curl -d`, typed as a form: Ollama's paths take any
    type from a client that is not a browser page (a page's cross-site post always carries Origin,
    and the content type is what would let it skip CORS's preflight)."""
    if request.content_type in ("application/json", ""):
        return True
    return is_ollama_path(request.path) and "Origin" not in request.headers


async def read_json(request: web.Request) -> object:
    if not _takes_body_as_json(request):
        raise bad_request(
            f"Content-Type must be application/json, got {request.content_type}.", code="invalid_content_type"
        )
    # Under the body deadline; aiohttp enforces client_max_size (413). Read once, then cached.
    cfg = request.app[SETTINGS].server
    body = await read_body(request, cfg.body_timeout_s)
    # Parsing costs ~0.3 us per array or object and holds the event loop (orjson keeps the GIL):
    # 20 MB of `[],` took 2.3 s. A request's text holds at most max_prompt_chars brackets, its
    # structure a bounded number more; counting bytes is a memchr pass.
    num_containers = body.count(b"[") + body.count(b"{")
    if num_containers > cfg.max_prompt_chars + _STRUCTURE_CONTAINERS:
        raise bad_request(
            f"The request body holds {num_containers} JSON arrays and objects (counting brackets in strings); "
            f"at most {cfg.max_prompt_chars + _STRUCTURE_CONTAINERS} are read.",
            code="invalid_json",
        )
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None


T = TypeVar("T")


async def parse_body(parse: Callable[..., T], raw: object, *args: Any, num_bytes: int) -> T:
    """`parse(raw, *args)`: on the event loop for a small body, on a worker thread for one of
    OFF_LOOP_CHARS bytes or more. Parsing compiles the JSON schemas a body holds (tools,
    response_format) with llguidance, about 0.1 s per 100 KB schema, which lets go of the GIL:
    a big body's schemas do not stall the streams the loop serves."""
    if num_bytes < attachments.OFF_LOOP_CHARS:
        return parse(raw, *args)
    return await asyncio.to_thread(parse, raw, *args)


@reads_body_itself
async def chat_completions(request: web.Request) -> web.StreamResponse:
    def parse(raw: object, cfg: ServerConfig) -> tuple[protocol.ChatRequest, Outlet | None]:
        if not (isinstance(raw, dict) and legacy_functions.uses_functions(raw)):
            return protocol.parse_chat_request(
                raw, max_messages=cfg.max_messages, max_prompt_chars=cfg.max_prompt_chars, max_n=cfg.max_n
            ), None
        try:
            chat = protocol.parse_chat_request(
                legacy_functions.as_tools_request(raw),
                max_messages=cfg.max_messages,
                max_prompt_chars=cfg.max_prompt_chars,
                max_n=cfg.max_n,
            )
        except ApiError as error:
            raise legacy_functions.in_old_names(error) from None
        return dataclasses.replace(chat, legacy_functions=True), None

    return await admit_and_serve(request, parse)


@dataclass(frozen=True, slots=True)
class Outlet:
    """How a job's answer reaches the client when it is not a chat completion (Responses, legacy
    completions, Anthropic's messages)."""

    serve: Callable[[web.Request, AppState, Job, Pass], Awaitable[web.StreamResponse]]
    refuse: Callable[[web.Request, AppState, Job, Any], Awaitable[web.StreamResponse]]


Parse = Callable[[object, ServerConfig], tuple[protocol.ChatRequest, Outlet | None]]


async def admit_and_serve(request: web.Request, parse: Parse) -> web.StreamResponse:
    """The front of every generating endpoint marked `reads_body_itself`: the cheap refusals
    (buckets, stream cap, load) before the body is read or parsed, then `parse` (the decoded
    JSON body into a chat request, and how its answer is rendered) and `serve_job`."""
    state = request.app[STATE]
    if state.draining:
        raise overloaded("The server is shutting down.", retry_after_s=5, code="server_shutting_down")
    caller = state.caller(request[PRINCIPAL])
    cfg = state.settings.server
    num_bytes = request.content_length  # above max_body_bytes it was a 413 already
    if num_bytes is None:  # chunked: no size before reading it
        num_bytes = len(await read_body(request, cfg.body_timeout_s))
    with state.admission.check(caller, request[REQUEST_ID], num_bytes) as grant, contextlib.ExitStack() as held:
        chat, outlet = await parse_body(parse, await read_json(request), cfg, num_bytes=num_bytes)
        if chat.conversation_id is not None:  # its turn: from reading the history to storing the answer
            org_id = request[PRINCIPAL].org.id
            held.callback(await state.turn_locks.acquire(org_id, chat.conversation_id, param="conversation_id"))
        return await serve_job(request, state, grant, chat, outlet)


async def serve_job(
    request: web.Request, state: AppState, grant: Pass, chat: protocol.ChatRequest, outlet: Outlet | None
) -> web.StreamResponse:
    """The one path from a validated request to its answer, for chat completions and Responses:
    route, budget, context, safety, admission, generation, billing."""
    principal = request[PRINCIPAL]
    state.admission.route(grant, chat.model)  # a saturated queue refuses before any store read
    if chat.conversation_id is None:
        return await _serve_job(request, state, grant, chat, outlet)
    # The turn will be stored: within the organisation's cap. Files sent inline are stored with
    # their message (parts_json), and counted with it.
    num_chars = sum(len(m.content) + num_inline_chars(m.parts) for m in chat.messages)
    await state.check_conversation_storage(principal, num_chars)  # counts the turn in its estimate
    job_box: list[Job] = []
    try:
        return await _serve_job(request, state, grant, chat, outlet, job_box)
    finally:
        if not (job_box and job_box[0].turn_stored):  # refused or failed: the estimate re-reads the store
            state.forget_conversation_bytes(principal.org.id)


async def _serve_job(
    request: web.Request,
    state: AppState,
    grant: Pass,
    chat: protocol.ChatRequest,
    outlet: Outlet | None,
    job_box: list[Job] | None = None,
) -> web.StreamResponse:
    principal = request[PRINCIPAL]
    if await state.over_budget(principal):
        state.admission.route(grant, chat.model, over_budget=True)
    inflight = request.app[INFLIGHT]
    with inflight.track():  # a shutdown waits for a request still reading its files, then answers it
        try:
            job = await _prepare(state, principal, grant, chat, request.app)
        except asyncio.CancelledError:
            if inflight.was_cut():
                raise shutting_down(started=False) from None
            raise
    if job_box is not None:
        job_box.append(job)
    if state.tracing is not None:
        job.trace_parent = state.tracing.parent_of(request.headers)
    verdict = await state.screen_prompt(job)
    if verdict is not None:
        return await (_refuse if outlet is None else outlet.refuse)(request, state, job, verdict)
    if not state.store.is_writable:
        raise overloaded(
            "The usage ledger cannot be written; try again later.", retry_after_s=30, code="store_unavailable"
        )
    spend = await state.month_spend_if_budgeted(principal)
    try:
        # The budget is checked and held with no await between: concurrent requests see each
        # other's holds. Shutdown waits for the request, then cuts it cleanly.
        with state.budget_reserved(job, spend), request.app[INFLIGHT].track():
            state.admission.place(grant, job.num_tokens_reserved, num_seqs=job.chat.n)
            if outlet is not None:
                return await outlet.serve(request, state, job, grant)
            if chat.stream:
                return await _serve_stream(request, state, job, grant)
            return await _serve_unary(request, state, job, grant)
    finally:  # the buckets settle on what the engine really processed
        grant.num_tokens_used = job.num_prompt_tokens + job.num_completion_tokens if grant.is_admitted else 0


async def _prepare(state: AppState, principal, grant: Pass, chat: protocol.ChatRequest, app: web.Application) -> Job:
    assert grant.route is not None
    history = None
    if chat.conversation_id is not None:
        conv = await state.store.get_conversation(principal.org.id, chat.conversation_id)
        if conv is None:
            raise conversation_not_found(chat.conversation_id)
        history = tuple(attachments.history_message(m) for m in conv.messages)
    inputs = JobInputs(
        request_id=grant.request_id,
        principal=principal,
        tier_name=grant.caller.tier_name,
        tier=grant.caller.tier,
        chat=chat,
        model=state.models[grant.route.model],
        fallback_from=grant.route.fallback_from,
        fallback_reason=grant.route.fallback_reason,
        history=history,
        cache_salt=state.cache_salt(principal),
    )
    # Files and images (api/attachments.py): resolved, checked against the model, fitted to the context.
    files, images = state.settings.files, state.settings.images
    ctx = AttachContext(state.store, app[BLOBS], principal.org.id, files, images, app[TEXTS])
    prepared = await attachments.prepare_job(ctx, inputs)
    prepared.job.truncated_files = tuple(t.as_dict() for t in prepared.truncated)
    return prepared.job


def _extra_fields(job: Job) -> dict:
    extra: dict = {}
    if job.chat.conversation_id is not None:
        extra["conversation_id"] = job.chat.conversation_id
        extra["history_messages_dropped"] = job.history_messages_dropped
    if job.truncated_files:
        extra["truncated_files"] = list(job.truncated_files)
    return extra


async def _serve_stream(request: web.Request, state: AppState, job: Job, grant: Pass) -> web.StreamResponse:
    stream = LazyStream(request, lambda: state.response_headers(job))
    created = chat_bodies.now_s()

    def chunk(delta: dict, finish: str | None = None) -> dict:
        usage = usage_of(state, job) if job.chat.continuous_usage else None
        return chat_bodies.chunk_body(
            job.completion_id, job.model.name, created, delta, finish, job.chat.include_usage, usage
        )

    answers = [make_answer(job) for _ in range(job.chat.n)]
    writer: SSEWriter | None = None  # opened once admitted

    async def send(index: int, deltas: list[dict]) -> None:
        for d in deltas:
            body = chunk(d["delta"])
            body["choices"][0].update(index=index, logprobs=d.get("logprobs"))
            assert writer is not None  # tokens flow only once admitted
            await writer.data(body)

    def emitter(index: int) -> Callable[[str, tuple[TokenLogprob, ...]], Awaitable[None]]:
        return lambda text, logprobs: send(index, answers[index].feed(text, logprobs))

    async def run() -> None:
        nonlocal writer
        await wait_admitted(state, grant, job, stream.comment)
        writer = await stream.open()
        for i in range(job.chat.n):
            await send(i, [{"delta": {"role": "assistant", "content": ""}}])
        finishes = await generate_choices(state, job, [emitter(i) for i in range(job.chat.n)], writer.comment)
        for i, answer in enumerate(answers):
            await send(i, answer.close())
        await finish_job(state, job, STATUS[finishes[0]], finishes[0])  # durable before the client sees the end
        for i, (answer, finish) in enumerate(zip(answers, finishes, strict=True)):
            body = chunk({}, answer.finish_reason(finish))
            body["choices"][0]["index"] = i
            await writer.data(body)
        if job.chat.include_usage:
            await writer.data(
                chat_bodies.usage_chunk_body(job.completion_id, job.model.name, created, usage_of(state, job))
            )
        await writer.done()

    return await stream_job(request, state, job, grant, stream, run)


async def _serve_unary(request: web.Request, state: AppState, job: Job, grant: Pass) -> web.Response:
    answers = [make_answer(job) for _ in range(job.chat.n)]
    finishes = await generate_unary(request, state, job, grant, answers)
    body = chat_bodies.completion_body(
        job.completion_id,
        job.model.name,
        chat_bodies.now_s(),
        "".join(job.text_parts),
        answers[0].finish_reason(finishes[0]),
        usage_of(state, job),
        _extra_fields(job),
    )
    body["choices"] = [
        {"index": i, "message": a.message(), "logprobs": a.logprobs_obj(), "finish_reason": a.finish_reason(f)}
        for i, (a, f) in enumerate(zip(answers, finishes, strict=True))
    ]
    return web.json_response(body, headers=state.response_headers(job), dumps=json_dumps)


def json_dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()


def usage_of(state: AppState, job: Job) -> dict:
    return chat_bodies.usage_dict(
        job.num_prompt_tokens,
        job.num_cached_tokens,
        job.num_completion_tokens,
        state.cost_usd(job),
        job.num_reasoning_tokens,
    )


async def _refuse(request: web.Request, state: AppState, job: Job, verdict) -> web.StreamResponse:
    """A prompt blocked before the engine: a refusal answer (or a 400 in error mode). The
    refusal is stored as the assistant message, with finish_reason content_filter."""
    refusal = await record_refusal(state, job, verdict)
    usage = chat_bodies.usage_dict(0, 0, 0, 0.0)
    created = chat_bodies.now_s()
    indices = range(job.chat.n)  # every choice asked for gets the refusal (code may index choices[1])
    if not job.chat.stream:
        body = chat_bodies.completion_body(
            job.completion_id, job.model.name, created, refusal, "content_filter", usage, _extra_fields(job)
        )
        body["choices"] = [{**body["choices"][0], "index": i} for i in indices]
        return web.json_response(body, headers=state.response_headers(job), dumps=json_dumps)
    writer = await SSEWriter.open(request, state.response_headers(job))

    def chunk(index: int, delta: dict, finish: str | None = None) -> dict:
        body = chat_bodies.chunk_body(job.completion_id, job.model.name, created, delta, finish, job.chat.include_usage)
        body["choices"][0]["index"] = index
        return body

    for i in indices:
        await writer.data(chunk(i, {"role": "assistant", "content": ""}))
        await writer.data(chunk(i, {"content": refusal}))
        await writer.data(chunk(i, {}, "content_filter"))
    if job.chat.include_usage:
        await writer.data(chat_bodies.usage_chunk_body(job.completion_id, job.model.name, created, usage))
    await writer.done()
    return writer.response


async def record_refusal(state: AppState, job: Job, verdict) -> str:
    """The one finish path of a prompt the safety gate blocked: its ledger row (prompt not
    billed) and, unless the gate answers with errors, the refusal stored as the answer. Returns
    the refusal text; in error mode raises the 400 instead (nothing stored)."""
    assert state.safety is not None  # only the safety gate blocks a prompt
    refusal = state.safety.refusal_text(verdict)  # the category's text (self-harm: where to get help)
    is_error = state.settings.safety.block_mode == "error"  # then no answer at all: a 400, nothing stored
    job.text_parts = [] if is_error else [refusal]
    await finish_job(
        state, job, RequestStatus.FILTERED, FinishReason.CONTENT_FILTER, prompt_billed=False, store_answer=not is_error
    )
    if is_error:
        raise ApiError(
            400,
            "The prompt was blocked by the content policy.",
            "invalid_request_error",
            "content_policy_violation",
            "prompt" if job.chat.raw_prompt is not None else "messages",
        )
    return refusal
