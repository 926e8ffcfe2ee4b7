"""`background: true` on POST /v1/responses: answer `queued` at once, serve the same request path
in a task that owns the admission grant (released there, once), and keep the stored row in step
(queued -> in_progress -> completed, incomplete, failed or cancelled); cancel, and stop what is
left at shutdown. The foreground path and the routes are in api/responses.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable

import orjson
import structlog
from aiohttp import web

from api.chat import Outlet, serve_job
from api.errors import ApiError, from_gateway
from api.finish import finish_quietly, generate_unary
from api.generation import make_answer
from api.inflight import INFLIGHT
from api.job import Job
from api.responses_record import ResponseContext, body_of, dumps, finished, insert, set_state, usage
from api.state import PRINCIPAL, AppState
from api.waiting import wait_admitted
from engine.types import FinishReason
from gateway.admission import Pass
from gateway.errors import GatewayError
from store.types import RequestStatus, StoreUnavailable

log = structlog.get_logger(__name__)
# The background responses running in this process, by (org id, response id): for cancel.
BACKGROUND = web.AppKey("background_responses", dict)
# A background response's final state after a restart, a crash or a failure before its answer.
RESTART_ERROR = {"code": "server_error", "message": "The server restarted before this background response finished."}
STOPPED_ERROR = {"code": "server_error", "message": "The server stopped before this background response finished."}
# The foreground's refusal (api/responses.py): a blocked prompt is stored and answered as there.
Refuse = Callable[[ResponseContext, web.Request, AppState, Job, object], Awaitable[web.StreamResponse]]


async def start_background(
    request: web.Request,
    state: AppState,
    grant: Pass,
    ctx: ResponseContext,
    owned: contextlib.ExitStack,
    refuse: Refuse,
) -> web.Response:
    """Serve the job in a task that owns the grant; answer `queued` as soon as the job is in the
    queue (its row stored first), or with the error that refused it before (a 4xx, as in the foreground)."""
    accepted: asyncio.Future[tuple[dict, dict]] = asyncio.get_running_loop().create_future()
    outlet = Outlet(
        serve=functools.partial(_serve_background, ctx, accepted),
        refuse=functools.partial(_refuse_background, refuse, ctx, accepted),
    )
    task = asyncio.create_task(
        _run_background(request, state, grant, ctx, outlet, owned), name=f"background-{ctx.response_id}"
    )
    running, key = request.app[BACKGROUND], (request[PRINCIPAL].org.id, ctx.response_id)
    running[key] = task
    task.add_done_callback(functools.partial(_forget, running, key, accepted))
    await asyncio.wait((accepted, task), return_when=asyncio.FIRST_COMPLETED)  # the client may leave: it runs on
    if not accepted.done():
        task.result()  # the refusal (ApiError, GatewayError) becomes this request's answer
        raise ApiError(500, "The background response ended before it was queued.", "server_error")
    body, headers = accepted.result()
    return web.json_response(body, headers=headers, dumps=dumps)


async def _run_background(
    request: web.Request,
    state: AppState,
    grant: Pass,
    ctx: ResponseContext,
    outlet: Outlet,
    owned: contextlib.ExitStack,
) -> None:
    with owned:  # the admission grant: its one release, whatever happens below
        try:
            await serve_job(request, state, grant, ctx.req.chat, outlet)
        finally:
            if ctx.new_conversation is not None and not ctx.stored:  # refused before it was queued
                await asyncio.shield(
                    state.store.discard_pending_conversation(request[PRINCIPAL].org.id, ctx.new_conversation)
                )


def _forget(running: dict, key: tuple[str, str], accepted: asyncio.Future, task: asyncio.Task) -> None:
    running.pop(key, None)
    if not task.cancelled() and task.exception() is not None and accepted.done():
        log.error("background_response_failed", response_id=key[1], error=repr(task.exception()))


async def _serve_background(
    ctx: ResponseContext, accepted: asyncio.Future, request: web.Request, state: AppState, job: Job, grant: Pass
) -> web.Response:
    """Runs inside the in-flight set (shutdown waits for it, then cuts it): queued -> in_progress -> final."""
    queued = body_of(ctx, job, {"status": "queued"})
    await insert(ctx, state, job, queued, ctx.num_history_messages)
    accepted.set_result((queued, state.response_headers(job)))
    answer = make_answer(job)
    finish: FinishReason | None = None  # set once the answer is billed and stored
    try:
        await wait_admitted(state, grant, job, None)
        await set_state(ctx, state, job, {"status": "in_progress"})
        (finish,) = await generate_unary(request, state, job, grant, [answer])
        if finish is FinishReason.ABORT:  # the engine stopped it (shutdown): not an answer
            await _fail(ctx, state, job, STOPPED_ERROR)
        else:
            await finished(ctx, state, job, answer, finish)
    except asyncio.CancelledError:
        finish = finish or job.finished_as  # cancelled while its complete answer was being stored
        if finish is not None and finish is not FinishReason.ABORT:  # a cancel too late: the answer stands
            _uncancel_current_task()
            try:
                await asyncio.shield(finished(ctx, state, job, answer, finish))
            except StoreUnavailable:  # the store logged it; the row is marked failed at the next start
                log.error("background_response_unsaved", response_id=ctx.response_id)
        elif request.app[INFLIGHT].was_cut() or state.draining:  # shutdown cut it (or stopped it, below)
            _uncancel_current_task()
            await _fail(ctx, state, job, STOPPED_ERROR)
        else:  # POST /v1/responses/{id}/cancel (or its DELETE)
            _uncancel_current_task()
            await finish_quietly(state, job, RequestStatus.ABORTED, FinishReason.ABORT)
            await set_state(ctx, state, job, {"status": "cancelled", "usage": usage(job)})
    except (ApiError, GatewayError) as exc:  # engine failure, shutdown, displaced from the queue
        error = exc if isinstance(exc, ApiError) else from_gateway(exc)
        await _fail(ctx, state, job, {"code": error.code or "server_error", "message": error.message})
    except StoreUnavailable:  # the store logged it; the row is marked failed at the next start
        log.error("background_response_unsaved", response_id=ctx.response_id)
    except Exception as exc:  # a bug: the client polling must still see an end
        log.exception("background_response_error", response_id=ctx.response_id)
        await _fail(ctx, state, job, {"code": "server_error", "message": f"{type(exc).__name__}"})
    return web.Response(status=204)


def _uncancel_current_task() -> None:
    """The cancellation was handled here: the task goes on to record the outcome."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


async def _refuse_background(
    refuse: Refuse,
    ctx: ResponseContext,
    accepted: asyncio.Future,
    request: web.Request,
    state: AppState,
    job: Job,
    verdict,
) -> web.Response:
    """A prompt the safety gate blocks: stored as the foreground stores it, then answered (not queued)."""
    response = await refuse(ctx, request, state, job, verdict)  # block_mode "error": a 400, nothing stored
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)  # JSON: background never streams
    accepted.set_result((orjson.loads(response.body), state.response_headers(job)))
    return response


async def _fail(ctx: ResponseContext, state: AppState, job: Job, error: dict) -> None:
    await finish_quietly(state, job, RequestStatus.ERROR, None)
    await set_state(ctx, state, job, {"status": "failed", "error": error, "usage": usage(job)})


async def stop_background(request: web.Request, response_id: str) -> bool:
    """Cancel this org's running background response and wait for its final row; False if none ran."""
    task = request.app[BACKGROUND].get((request[PRINCIPAL].org.id, response_id))
    if task is None or task.done():
        return False
    task.cancel()
    await asyncio.wait({task}, timeout=30.0)
    return True


async def stop_all_background(app: web.Application) -> None:
    """At shutdown, after the in-flight drain: stop what is left, so each row says `failed`
    while the store is still open (a crash leaves that to the next start)."""
    tasks = [t for t in app[BACKGROUND].values() if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=10.0)
