"""How a job ends: the one finish path (`finish_job`) and the failure ladders around it.

`finish_job` writes exactly one ledger row and the conversation's messages before the client
sees the end of its answer. `stream_job` (streamed) and `generate_unary` (not streamed) run a
job to its end for chat completions and Responses alike, so a disconnect, a shutdown, an
engine error and an unwritable store each have one finish path.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog
from aiohttp import web

from api.errors import ApiError, from_gateway, overloaded
from api.generation import Emit, generate_choices
from api.inflight import INFLIGHT
from api.job import Job
from api.reasoning import answer_text
from api.sse import ClientGone, SSEWriter
from api.state import AppState
from api.waiting import LazyStream, wait_admitted
from engine.types import EngineError, EngineUnavailable, FinishReason, ModelLoadFailed, RequestRejected, TokenLogprob
from gateway.admission import Pass
from gateway.errors import Overloaded
from store.types import RequestRecord, RequestStatus, StoreUnavailable

log = structlog.get_logger(__name__)

# A finish reason's ledger status.
STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED,
    FinishReason.LENGTH: RequestStatus.FINISHED,
    FinishReason.ABORT: RequestStatus.ABORTED,
    FinishReason.CONTENT_FILTER: RequestStatus.FILTERED,
}
_STORED_EMPTY = (RequestStatus.FINISHED, RequestStatus.FILTERED)  # an empty answer is still stored


async def stream_job(
    request: web.Request,
    state: AppState,
    job: Job,
    grant: Pass,
    stream: LazyStream,
    run: Callable[[], Awaitable[None]],
    render_error: RenderError | None = None,
) -> web.StreamResponse:
    """Run one streamed answer (`run`: admission, generation, the durable write, the last frames)
    under the failure ladder chat completions and Responses share: each failure has one finish path.
    `render_error`: the error's frames in this API's own shape (else the chat completions' error frame)."""
    try:
        await run()
    except StoreUnavailable:  # the answer could not be stored: no finish_reason, no [DONE]
        await _stream_error(await stream.open(), store_unavailable(), job, render_error, is_done=False)
    except (ClientGone, asyncio.CancelledError):
        is_cut = request.app[INFLIGHT].was_cut()
        await finish_quietly(
            state, job, RequestStatus.ABORTED, FinishReason.ABORT, store_turn=not _refused(job, is_cut)
        )
        if not is_cut:
            raise asyncio.CancelledError() from None
        if not stream.is_open:
            raise shutting_down(started=False) from None  # still queued: a plain 503
        await _stream_error(await stream.open(), shutting_down(), job, render_error, is_done=False)
    except Overloaded as exc:  # displaced from the queue by a higher tier
        if not stream.is_open:
            raise  # nothing sent yet: a plain 503 with Retry-After
        grant.close(refund=True)
        await _stream_error(await stream.open(), from_gateway(exc), job, render_error)
    except (EngineError, RequestRejected, ApiError) as exc:
        await finish_quietly(state, job, RequestStatus.ERROR, None)
        await _stream_error(await stream.open(), exc, job, render_error)
    return (await stream.open()).response


# Writes an error's frames into an open stream (the end itself, [DONE] or not, is _stream_error's).
RenderError = Callable[[SSEWriter, ApiError], Awaitable[None]]


async def _stream_error(
    writer: SSEWriter, exc: Exception, job: Job, render: RenderError | None, *, is_done: bool = True
) -> None:
    """After headers are sent an error is one `data:` frame with the error object (or what
    `render` writes), then the end.

    `[DONE]` follows only errors of the request itself (4xx); an answer cut by the server (an
    engine failure, store unavailable, shutdown: 5xx) ends without it, so no client mistakes it
    for a stored answer.
    """
    error = engine_api_error(exc, is_streamed=True)
    if error.code == "server_shutting_down":  # the operator stopped the server: expected, not a fault
        log.warning("stream_cut_at_shutdown", request_id=job.request_id)
    else:
        log.error("stream_failed", request_id=job.request_id, code=error.code, error=str(exc))
    try:
        await (render(writer, error) if render is not None else writer.data(error.body()))
        await (writer.done() if is_done and error.status < 500 else writer.end())
    except ClientGone:
        pass


def engine_api_error(exc: Exception, *, is_streamed: bool = False) -> ApiError:
    """A backend's failure in our envelope: the caller's fault (400), unreachable (503), else 500.
    `is_streamed`: it goes into a stream, whose headers (Retry-After's) were sent before it."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestRejected):  # e.g. an upstream server's 400, passed on with its message
        return ApiError(400, exc.message, "invalid_request_error", exc.code or "invalid_value", exc.param)
    if isinstance(exc, ModelLoadFailed):
        return overloaded(
            f"The model '{exc.model}' could not be loaded on this server (its log says why); try again later "
            "or ask for another model.",
            retry_after_s=30,
            code="model_load_failed",
        )
    if isinstance(exc, EngineUnavailable):
        seconds = max(1, math.ceil(exc.retry_after_s))
        when = f"in {seconds} s" if is_streamed else "after the time in the Retry-After header"
        return overloaded(
            f"The model is unavailable right now; please retry {when}.",
            retry_after_s=exc.retry_after_s,
            code="model_unavailable",
        )
    return ApiError(500, "The model failed while generating.", "server_error", "engine_error")


def store_unavailable() -> ApiError:
    return overloaded(
        "The answer could not be stored (the database cannot be written); it was not saved "
        "or acknowledged. Try again later.",
        retry_after_s=30,
        code="store_unavailable",
    )


def shutting_down(*, started: bool = True) -> ApiError:
    if not started:  # still queued: nothing generated, nothing billed
        return overloaded("The server is shutting down; retry shortly.", retry_after_s=5, code="server_shutting_down")
    return overloaded(
        "The server is shutting down; the answer was cut here (the tokens generated are billed).",
        retry_after_s=5,
        code="server_shutting_down",
    )


def _refused(job: Job, is_cut: bool) -> bool:
    """Still queued when the server stopped: the client gets a plain 503 inviting a retry, so its
    turn is not stored (the retry would find its message twice)."""
    return is_cut and job.admitted_s is None


async def finish_quietly(
    state: AppState, job: Job, status: RequestStatus, finish: FinishReason | None, *, store_turn: bool = True
) -> None:
    """The finish path of an answer that already failed: bill only work done (nothing if it never left the
    queue, nor a relayed request whose upstream failed before anything was passed on); a store error is
    logged by the store, not raised."""
    relayed_nothing = job.model.config.backend == "openai" and job.first_token_s is None
    billed = job.admitted_s is not None and not (status is RequestStatus.ERROR and relayed_nothing)
    try:
        await finish_job(state, job, status, finish, prompt_billed=billed, store_turn=store_turn)
    except StoreUnavailable:
        pass


class Collector(Protocol):
    """What `generate_unary` feeds each choice's text into: a chat `Answer`, or a raw completion's text."""

    def feed(self, text: str, logprobs: tuple[TokenLogprob, ...]) -> object: ...

    def close(self) -> object: ...


async def generate_unary(
    request: web.Request, state: AppState, job: Job, grant: Pass, answers: Sequence[Collector]
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
        finishes = await generate_choices(state, job, [emitter(i) for i in range(len(answers))], None)
        for answer in answers:
            answer.close()
    except asyncio.CancelledError:  # client went away (handler cancellation) or shutdown
        is_cut = request.app[INFLIGHT].was_cut()
        await finish_quietly(
            state, job, RequestStatus.ABORTED, FinishReason.ABORT, store_turn=not _refused(job, is_cut)
        )
        if is_cut:
            raise shutting_down(started=job.admitted_s is not None) from None
        raise
    except (EngineError, RequestRejected) as exc:
        await finish_quietly(state, job, RequestStatus.ERROR, None)
        log.error("request_failed", request_id=job.request_id, error=str(exc))
        raise engine_api_error(exc) from None
    # The answer is complete: a cancel landing now (a background response's) waits until it is
    # billed and stored, so whoever handles the cancel finds the answer recorded (job.finished_as).
    storing = asyncio.ensure_future(finish_job(state, job, STATUS[finishes[0]], finishes[0]))
    try:
        await asyncio.shield(storing)
    except asyncio.CancelledError:
        await storing
        raise
    return finishes


async def finish_job(
    state: AppState,
    job: Job,
    status: RequestStatus,
    finish: FinishReason | None,
    *,
    prompt_billed: bool = True,
    store_answer: bool = True,
    store_turn: bool = True,
) -> None:
    """The one place a request is billed and its messages stored (idempotent on request_id)."""
    if job.recorded:
        return
    job.recorded = True
    job.finished_as = finish
    end = time.monotonic()
    num_prompt = job.num_prompt_tokens if prompt_billed else 0
    cached = job.num_cached_tokens if prompt_billed else 0
    content = "".join(job.text_parts)
    if job.reasoning_opened is not None:  # the conversation keeps the answer, not the thinking
        content = answer_text(content, in_thinking=job.reasoning_opened)
    new_messages, new_parts = job.new_messages, job.new_message_parts
    if prompt_billed and job.chat.continue_final_message and new_messages and new_messages[-1][0] == "assistant":
        # A prefill and its continuation are one answer in the conversation, as the model wrote it.
        content = new_messages[-1][1] + content
        new_messages, new_parts = new_messages[:-1], new_parts[: len(new_messages) - 1]
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
        reasoning_tokens=job.num_reasoning_tokens,
        cost_usd=state.cost_usd(job) if prompt_billed else 0.0,
        queue_ms=_ms(job.arrival_s, job.admitted_s),
        ttft_ms=_ms(job.arrival_s, job.first_token_s),
        total_ms=_ms(job.arrival_s, end),
        created_at=job.created_at,
        finished_at=time.time(),
        conversation_id=job.chat.conversation_id if store_turn else None,
        new_messages=new_messages if store_turn else (),
        new_message_parts=new_parts,
        # A refused or filtered answer is stored too (the text sent, maybe none), so the
        # conversation shows what happened after a reload.
        assistant_content=content if store_answer and (content or status in _STORED_EMPTY) else None,
        fallback_from=job.fallback_from,
        fallback_reason=job.fallback_reason,
        history_messages_dropped=job.history_messages_dropped,
        usage_source=job.usage_source.value,
        # An answer the server cut (an engine failure) is stored as "error", so that after a
        # reload it does not pass for a complete one.
        finish_reason=finish.value if finish is not None else ("error" if status is RequestStatus.ERROR else None),
    )
    await state.record(job, record, finish)
    job.turn_stored = store_turn and job.chat.conversation_id is not None


def _ms(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1000.0, 3)
