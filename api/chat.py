"""POST /v1/chat/completions: the request path from validated body to SSE or JSON.

Owns the order of the request path: the cheap refusals first (rate limits and the stream
cap, sized from the body's bytes), then validate, read the store, route, tokenize, screen,
place in the queue, generate, filter, bill. `finish_job` is the one finish path per request:
exactly one ledger row and the conversation messages before the client sees the end of its
answer; the admission `Pass` releases the bucket, stream slot and queue ticket exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from aiohttp import web

from api import attachments, protocol
from api.answer import Answer
from api.connections import read_body, reads_body_itself
from api.errors import ApiError, bad_request, from_gateway, overloaded
from api.files import BLOBS
from api.inflight import INFLIGHT
from api.job import Job, JobInputs, conversation_not_found
from api.reasoning import ReasoningSplitter, answer_text
from api.sse import ClientGone, SSEWriter
from api.state import PRINCIPAL, REQUEST_ID, SETTINGS, STATE, AppState
from api.toolparse import ToolCallParser
from api.tools import ChoiceMode, detect_format
from api.waiting import LazyStream, wait_admitted
from engine.types import (
    EngineError,
    EngineUnavailable,
    FinishReason,
    RequestRejected,
    TokenEvent,
    TokenLogprob,
    UsageSource,
)
from gateway.admission import Pass
from gateway.errors import Overloaded
from store.types import RequestRecord, RequestStatus, StoreUnavailable

log = structlog.get_logger(__name__)

_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED,
    FinishReason.LENGTH: RequestStatus.FINISHED,
    FinishReason.ABORT: RequestStatus.ABORTED,
    FinishReason.CONTENT_FILTER: RequestStatus.FILTERED,
}


_STORED_EMPTY = (RequestStatus.FINISHED, RequestStatus.FILTERED)  # an empty answer is still stored


async def read_json(request: web.Request) -> object:
    if request.content_type not in ("application/json", ""):
        raise bad_request(f"Content-Type must be application/json, got {request.content_type}.", code="invalid_content_type")
    # Under the body deadline; aiohttp enforces client_max_size (413). Read once, then cached.
    body = await read_body(request, request.app[SETTINGS].server.body_timeout_s)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None


@reads_body_itself
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if state.draining:
        raise overloaded("The server is shutting down.", retry_after_s=5, code="server_shutting_down")
    caller = state.caller(request[PRINCIPAL])
    cfg = state.settings.server
    num_bytes = request.content_length  # above max_body_bytes it was a 413 already
    if num_bytes is None:  # chunked: no size before reading it
        num_bytes = len(await read_body(request, cfg.body_timeout_s))
    # The cheap refusals (buckets, stream cap, load) come before the body is read or parsed.
    with state.admission.check(caller, request[REQUEST_ID], num_bytes) as grant:
        return await _admit_and_serve(request, state, grant)


@dataclass(frozen=True, slots=True)
class Outlet:
    """How a job's answer reaches the client when it is not a chat completion (the Responses API)."""

    serve: Callable[[web.Request, AppState, Job, Pass], Awaitable[web.StreamResponse]]
    refuse: Callable[[web.Request, AppState, Job, Any], Awaitable[web.StreamResponse]]


async def _admit_and_serve(request: web.Request, state: AppState, grant: Pass) -> web.StreamResponse:
    cfg = state.settings.server
    chat = protocol.parse_chat_request(
        await read_json(request), max_messages=cfg.max_messages, max_prompt_chars=cfg.max_prompt_chars, max_n=cfg.max_n
    )
    return await serve_job(request, state, grant, chat, None)


async def serve_job(
    request: web.Request, state: AppState, grant: Pass, chat: protocol.ChatRequest, outlet: Outlet | None
) -> web.StreamResponse:
    """The one path from a validated request to its answer, for chat completions and Responses:
    route, budget, context, safety, admission, generation, billing."""
    principal = request[PRINCIPAL]
    state.admission.route(grant, chat.model)  # a saturated queue refuses before any store read
    if await state.over_budget(principal):
        state.admission.route(grant, chat.model, over_budget=True)
    job = await _prepare(state, principal, grant, chat, request.app[BLOBS])
    verdict = await state.screen_prompt(job)
    if verdict is not None:
        return await (_refuse if outlet is None else outlet.refuse)(request, state, job, verdict)
    if not state.store.is_writable:
        raise overloaded("The usage ledger cannot be written; try again later.", retry_after_s=30,
                         code="store_unavailable")
    state.admission.place(grant, job.num_tokens_reserved, num_seqs=job.chat.n)
    try:
        with request.app[INFLIGHT].track():  # shutdown waits for it, then cuts it cleanly
            if outlet is not None:
                return await outlet.serve(request, state, job, grant)
            if chat.stream:
                return await _serve_stream(request, state, job, grant)
            return await _serve_unary(request, state, job, grant)
    finally:  # the buckets settle on what the engine really processed
        grant.num_tokens_used = job.num_prompt_tokens + job.num_completion_tokens if grant.is_admitted else 0


async def _prepare(state: AppState, principal, grant: Pass, chat: protocol.ChatRequest, blobs) -> Job:
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
        history=history,
        cache_salt=state.cache_salt(principal),
    )
    # Files and images (api/attachments.py): resolved, checked against the model, fitted to the context.
    ctx = attachments.AttachContext(state.store, blobs, principal.org.id, state.settings.files, state.settings.images)
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
    created = protocol.now_s()

    def chunk(delta: dict, finish: str | None = None) -> dict:
        usage = _usage(state, job) if job.chat.continuous_usage else None
        return protocol.chunk_body(job.completion_id, job.model.name, created, delta, finish, job.chat.include_usage, usage)

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
        finishes = await pump_choices(state, job, [emitter(i) for i in range(job.chat.n)], writer.comment)
        for i, answer in enumerate(answers):
            await send(i, answer.close())
        await finish_job(state, job, _STATUS[finishes[0]], finishes[0])  # durable before the client sees the end
        for i, (answer, finish) in enumerate(zip(answers, finishes, strict=True)):
            body = chunk({}, answer.finish_reason(finish))
            body["choices"][0]["index"] = i
            await writer.data(body)
        if job.chat.include_usage:
            await writer.data(protocol.usage_chunk_body(job.completion_id, job.model.name, created, _usage(state, job)))
        await writer.done()

    return await stream_job(request, state, job, grant, stream, run)


async def stream_job(
    request: web.Request, state: AppState, job: Job, grant: Pass, stream: LazyStream,
    run: Callable[[], Awaitable[None]],
) -> web.StreamResponse:
    """Run one streamed answer (`run`: admission, generation, the durable write, the last frames)
    under the failure ladder chat completions and Responses share: each failure has one finish path."""
    try:
        await run()
    except StoreUnavailable:  # the answer could not be stored: no finish_reason, no [DONE]
        await _stream_error(await stream.open(), store_unavailable(), job, is_done=False)
    except (ClientGone, asyncio.CancelledError):
        is_cut = request.app[INFLIGHT].was_cut()
        await _finish_quietly(state, job, RequestStatus.ABORTED, FinishReason.ABORT)
        if not is_cut:
            raise asyncio.CancelledError() from None
        if not stream.is_open:
            raise shutting_down() from None  # still queued: a plain 503
        await _stream_error(await stream.open(), shutting_down(), job, is_done=False)
    except Overloaded as exc:  # displaced from the queue by a higher tier
        if not stream.is_open:
            raise  # nothing sent yet: a plain 503 with Retry-After
        grant.close(refund=True)
        await _stream_error(await stream.open(), from_gateway(exc), job)
    except (EngineError, RequestRejected, ApiError) as exc:
        await _finish_quietly(state, job, RequestStatus.ERROR, None)
        await _stream_error(await stream.open(), exc, job)
    return (await stream.open())._response


async def _stream_error(writer: SSEWriter, exc: Exception, job: Job, *, is_done: bool = True) -> None:
    """After headers are sent an error is one `data:` frame with the error object, then the end.

    `[DONE]` follows only errors of the request itself; an answer cut by the server (store
    unavailable, shutdown) ends without it, so no client mistakes it for a stored answer.
    """
    error = _engine_api_error(exc)
    log.error("stream_failed", request_id=job.request_id, code=error.code, error=str(exc))
    try:
        await writer.data(error.body())
        await (writer.done() if is_done else writer.end())
    except ClientGone:
        pass


def _engine_api_error(exc: Exception) -> ApiError:
    """A backend's failure in our envelope: the caller's fault (400), unreachable (503), else 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestRejected):  # e.g. an upstream server's 400, passed on with its message
        return ApiError(400, exc.message, "invalid_request_error", exc.code or "invalid_value", exc.param)
    if isinstance(exc, EngineUnavailable):
        return overloaded("The model is unavailable right now; please retry after the time in the Retry-After header.",
                          retry_after_s=exc.retry_after_s, code="model_unavailable")
    return ApiError(500, "The model failed while generating.", "server_error", "engine_error")


def store_unavailable() -> ApiError:
    return overloaded("The answer could not be stored (the database cannot be written); it was not saved "
                      "or acknowledged. Try again later.", retry_after_s=30, code="store_unavailable")


def shutting_down() -> ApiError:
    return overloaded("The server is shutting down; the answer was cut here (the tokens generated are billed).",
                      retry_after_s=5, code="server_shutting_down")


async def _finish_quietly(state: AppState, job: Job, status: RequestStatus, finish: FinishReason | None) -> None:
    """The finish path of an answer that already failed: bill only work done (nothing if it never left the
    queue); a store error is logged by the store, not raised."""
    try:
        await finish_job(state, job, status, finish, prompt_billed=job.admitted_s is not None)
    except StoreUnavailable:
        pass


async def generate_unary(
    request: web.Request, state: AppState, job: Job, grant: Pass, answers: list[Answer]
) -> list[FinishReason]:
    """A non-streaming job run to its end, one `Answer` per choice, the durable write done before it
    returns (StoreUnavailable: 503, nothing acknowledged). Chat completions and Responses both call it,
    so a disconnect, a shutdown and an engine error each have one finish path."""

    def emitter(index: int) -> Emit:
        async def emit(text: str, logprobs: tuple[TokenLogprob, ...]) -> None:
            answers[index].feed(text, logprobs)
        return emit

    try:
        await wait_admitted(state, grant, job, None)
        finishes = await pump_choices(state, job, [emitter(i) for i in range(len(answers))], None)
        for answer in answers:
            answer.close()
    except asyncio.CancelledError:  # client went away (handler cancellation) or shutdown
        is_cut = request.app[INFLIGHT].was_cut()
        await _finish_quietly(state, job, RequestStatus.ABORTED, FinishReason.ABORT)
        if is_cut:
            raise shutting_down() from None
        raise
    except (EngineError, RequestRejected) as exc:
        await _finish_quietly(state, job, RequestStatus.ERROR, None)
        log.error("request_failed", request_id=job.request_id, error=str(exc))
        raise _engine_api_error(exc) from None
    await finish_job(state, job, _STATUS[finishes[0]], finishes[0])
    return finishes


async def _serve_unary(request: web.Request, state: AppState, job: Job, grant: Pass) -> web.Response:
    answers = [make_answer(job) for _ in range(job.chat.n)]
    finishes = await generate_unary(request, state, job, grant, answers)
    body = protocol.completion_body(
        job.completion_id, job.model.name, protocol.now_s(), "".join(job.text_parts),
        answers[0].finish_reason(finishes[0]), _usage(state, job), _extra_fields(job),
    )
    body["choices"] = [
        {"index": i, "message": a.message(), "logprobs": a.logprobs_obj(), "finish_reason": a.finish_reason(f)}
        for i, (a, f) in enumerate(zip(answers, finishes, strict=True))
    ]
    return web.json_response(body, headers=state.response_headers(job), dumps=_dumps)


def make_answer(job: Job) -> Answer:
    """The client's view of the generation: tool calls parsed when tools may be called."""
    chat, tokenizer = job.chat, job.model.tokenizer
    parser = None
    if chat.tools and chat.tool_choice.mode is not ChoiceMode.NONE:
        fmt = detect_format(getattr(tokenizer, "chat_template", None), job.model.config.tool_parser)
        parser = ToolCallParser(fmt, frozenset(t.name for t in chat.tools))
    reasoning = None if job.reasoning_opened is None else ReasoningSplitter(in_thinking=job.reasoning_opened)
    return Answer(tokenizer, parser, chat.logprobs, reasoning)


def _dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()


Emit = Callable[[str, tuple[TokenLogprob, ...]], Awaitable[None]]


async def pump_choices(
    state: AppState, job: Job, emits: list[Emit], on_idle: Callable[[str], Awaitable[None]] | None
) -> list[FinishReason]:
    """Generate the n choices; each finish reason. Choices after the first start once the first
    has its first token, so that they find the prompt's KV blocks in the prefix cache."""
    job.completion_tokens_by_choice = [0] * len(emits)
    first = asyncio.ensure_future(_pump(state, job, emits[0], on_idle))
    tasks = [first]
    try:
        while len(emits) > 1 and job.first_token_s is None and not first.done():
            await asyncio.wait({first}, timeout=0.005)
        tasks += [asyncio.ensure_future(_pump(state, job, emit, None, i)) for i, emit in enumerate(emits) if i]
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # no-op once done; closing each generator aborts it in the engine
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(
    state: AppState,
    job: Job,
    emit: Emit,
    on_idle: Callable[[str], Awaitable[None]] | None,
    choice: int = 0,
) -> FinishReason:
    """Run one choice's generation, filtering output; returns the finish reason. Closing aborts."""
    out_filter = state.output_filter(job)
    events = state.generate(job, choice)
    finish = FinishReason.STOP
    try:
        while (event := await _next_event(events, job, state, on_idle)) is not None:
            _count(job, event, choice)
            text = event.text
            if out_filter is not None:
                text, blocked = await out_filter.feed(text)
                if blocked is not None and not blocked.allowed:
                    state.count_filtered(job, blocked)
                    return FinishReason.CONTENT_FILTER
            if text and choice == 0:
                job.text_parts.append(text)
            if text or event.logprobs:
                await emit(text, event.logprobs)
            if event.finish_reason is not None:
                finish = event.finish_reason
        if out_filter is not None:
            tail, blocked = await out_filter.finish()
            if blocked is not None and not blocked.allowed:
                state.count_filtered(job, blocked)
                return FinishReason.CONTENT_FILTER
            if tail:
                if choice == 0:
                    job.text_parts.append(tail)
                await emit(tail, ())
        return finish
    finally:
        await events.aclose()  # aborts the request in the backend if it is still running


async def _next_event(
    events: AsyncIterator[TokenEvent], job: Job, state: AppState, on_idle: Callable[[str], Awaitable[None]] | None
) -> TokenEvent | None:
    """The next event; until the first token, send a heartbeat comment every heartbeat_s."""
    if job.first_token_s is not None or on_idle is None:
        return await anext(events, None)
    task = asyncio.ensure_future(anext(events, None))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=state.settings.server.heartbeat_s)
            if done:
                return task.result()
            await on_idle("processing")
    finally:
        if not task.done():
            # Let the cancelled step finish before anyone closes the generator.
            task.cancel()
            await asyncio.wait({task})


def _count(job: Job, event: TokenEvent, choice: int = 0) -> None:
    """Cumulative counts; the prompt (and its cache hit) is counted once, by choice 0."""
    if choice == 0 and event.usage_source is not UsageSource.ENGINE:  # counted upstream, or recounted for it
        job.reported_prompt_tokens = event.num_prompt_tokens
        job.usage_source = event.usage_source
    if choice == 0:
        job.num_cached_tokens = event.num_cached_tokens
    job.completion_tokens_by_choice[choice] = event.num_completion_tokens
    job.num_completion_tokens = sum(job.completion_tokens_by_choice)
    if job.first_token_s is None and event.num_completion_tokens > 0:
        job.first_token_s = time.monotonic()


def _usage(state: AppState, job: Job) -> dict:
    return protocol.usage_dict(
        job.num_prompt_tokens, job.num_cached_tokens, job.num_completion_tokens, state.cost_usd(job)
    )


async def _refuse(request: web.Request, state: AppState, job: Job, verdict) -> web.StreamResponse:
    """A prompt blocked before the engine: a refusal answer (or a 400 in error mode). The
    refusal is stored as the assistant message, with finish_reason content_filter."""
    cfg = state.settings.safety
    assert state.safety is not None  # only the safety gate blocks a prompt
    refusal = state.safety.refusal_text(verdict)  # the category's text (self-harm: where to get help)
    is_error = cfg.block_mode == "error"  # then no answer at all: a 400, nothing stored
    job.text_parts = [] if is_error else [refusal]
    await finish_job(state, job, RequestStatus.FILTERED, FinishReason.CONTENT_FILTER, prompt_billed=False,
                      store_answer=not is_error)
    if is_error:
        raise ApiError(400, "The prompt was blocked by the content policy.", "invalid_request_error",
                       "content_policy_violation", "messages")
    usage = protocol.usage_dict(0, 0, 0, 0.0)
    created = protocol.now_s()
    if not job.chat.stream:
        body = protocol.completion_body(job.completion_id, job.model.name, created, refusal,
                                        "content_filter", usage, _extra_fields(job))
        return web.json_response(body, headers=state.response_headers(job), dumps=_dumps)
    writer = await SSEWriter.open(request, state.response_headers(job))
    mk = protocol.chunk_body
    await writer.data(mk(job.completion_id, job.model.name, created, {"role": "assistant", "content": ""}, None, job.chat.include_usage))
    await writer.data(mk(job.completion_id, job.model.name, created, {"content": refusal}, None, job.chat.include_usage))
    await writer.data(mk(job.completion_id, job.model.name, created, {}, "content_filter", job.chat.include_usage))
    if job.chat.include_usage:
        await writer.data(protocol.usage_chunk_body(job.completion_id, job.model.name, created, usage))
    await writer.done()
    return writer._response


async def finish_job(
    state: AppState, job: Job, status: RequestStatus, finish: FinishReason | None, *, prompt_billed: bool = True,
    store_answer: bool = True,
) -> None:
    """The one place a request is billed and its messages stored (idempotent on request_id)."""
    if job.recorded:
        return
    job.recorded = True
    end = time.monotonic()
    num_prompt = job.num_prompt_tokens if prompt_billed else 0
    cached = job.num_cached_tokens if prompt_billed else 0
    content = "".join(job.text_parts)
    if job.reasoning_opened is not None:  # the conversation keeps the answer, not the thinking
        content = answer_text(content, in_thinking=job.reasoning_opened)
    record = RequestRecord(
        request_id=job.request_id,
        org_id=job.principal.org.id,
        key_id=job.principal.key_id,
        model=job.model.name,
        tier=job.tier_name,
        status=status,
        prompt_tokens=num_prompt,
        cached_tokens=cached,
        completion_tokens=job.num_completion_tokens,
        cost_usd=state.cost_usd(job) if prompt_billed else 0.0,
        queue_ms=_ms(job.arrival_s, job.admitted_s),
        ttft_ms=_ms(job.arrival_s, job.first_token_s),
        total_ms=_ms(job.arrival_s, end),
        created_at=job.created_at,
        finished_at=time.time(),
        conversation_id=job.chat.conversation_id,
        new_messages=job.new_messages,
        new_message_parts=job.new_message_parts,
        # A refused or filtered answer is stored too (the text sent, maybe none), so the
        # conversation shows what happened after a reload.
        assistant_content=content if store_answer and (content or status in _STORED_EMPTY) else None,
        fallback_from=job.fallback_from,
        usage_source=job.usage_source.value,
        finish_reason=finish.value if finish is not None else None,
    )
    await state.record(job, record, finish)


def _ms(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1000.0, 3)
