"""The Responses API: POST /v1/responses, GET/DELETE /v1/responses/{id}, GET .../input_items.

A response is served by the chat completions' request path (`chat.serve_job`: routing, budget,
context, safety, admission, priority queue, generation, billing); only its rendering differs.
With `store` (the default) it is a turn of a conversation in the caller's organisation (the web
UI lists it, retention purges it) plus a row with the response object; `previous_response_id`
continues that conversation, so the prompt's prefix is in the KV cache. Other orgs get 404.
`background: true` answers `queued` at once and serves the same path in a task that owns the
admission grant (released there, once); the stored row follows it to completed, failed or cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from dataclasses import dataclass, replace

import orjson
import structlog
from aiohttp import web

from api import attachments, protocol
from api.answer import Answer
from api.chat import Outlet, read_json, serve_job
from api.errors import ApiError, bad_request, from_gateway, not_found, overloaded
from api.finish import STATUS, finish_job, finish_quietly, generate_unary, stream_job
from api.generation import generate_choices, make_answer
from api.inflight import INFLIGHT
from api.job import Job
from api.responses_wire import (
    ResponsesRequest,
    event_logprobs,
    function_call_item,
    message_item,
    new_id,
    output_items,
    output_text_part,
    parse_responses_request,
    response_object,
    usage_object,
)
from api.sse import SSEWriter
from api.state import PRINCIPAL, REQUEST_ID, STATE, AppState
from api.tools import ToolCall
from api.waiting import LazyStream, wait_admitted
from engine.types import FinishReason
from gateway.admission import Pass
from gateway.errors import GatewayError
from store.conversations import title_from
from store.responses import UNFINISHED, StoredResponse
from store.types import RequestStatus, StoreUnavailable

log = structlog.get_logger(__name__)
# The background responses running in this process, by (org id, response id): for cancel.
BACKGROUND = web.AppKey("background_responses", dict)
# A background response's final state after a restart, a crash or a failure before its answer.
RESTART_ERROR = {"code": "server_error", "message": "The server restarted before this background response finished."}
STOPPED_ERROR = {"code": "server_error", "message": "The server stopped before this background response finished."}
_INCOMPLETE = {FinishReason.LENGTH: "max_output_tokens", FinishReason.CONTENT_FILTER: "content_filter"}


@dataclass(slots=True)
class _Context:
    req: ResponsesRequest
    response_id: str
    created: int
    message_id: str
    stored: bool = False


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if state.draining:
        raise overloaded("The server is shutting down.", retry_after_s=5, code="server_shutting_down")
    caller = state.caller(request[PRINCIPAL])
    declared = request.content_length
    num_bytes = len(await request.read()) if declared is None else min(declared, state.settings.server.max_body_bytes)
    with contextlib.ExitStack() as owned:
        grant = owned.enter_context(state.admission.check(caller, request[REQUEST_ID], num_bytes))  # as chat
        cfg = state.settings.server
        req = parse_responses_request(
            await read_json(request), max_messages=cfg.max_messages, max_prompt_chars=cfg.max_prompt_chars
        )
        org_id = request[PRINCIPAL].org.id
        req, new_conversation = await _with_history(state, org_id, req)
        ctx = _Context(req, new_id("resp"), protocol.now_s(), new_id("msg"))
        if req.background:  # the grant goes to the task that serves it
            return await _start_background(request, state, grant, ctx, (owned.pop_all(), new_conversation))
        outlet = Outlet(serve=functools.partial(_serve, ctx), refuse=functools.partial(_refuse, ctx))
        try:
            return await serve_job(request, state, grant, req.chat, outlet)
        finally:
            if new_conversation is not None and not ctx.stored:  # refused before an answer: leave no trace
                await asyncio.shield(state.store.delete_conversation(org_id, new_conversation))


async def _with_history(state: AppState, org_id: str, req: ResponsesRequest) -> tuple[ResponsesRequest, str | None]:
    """Attach the conversation to continue (or a new one, to store into); returns the id it created."""
    conversation_id = None
    if req.previous_response_id is not None:
        prev = await state.store.get_response(org_id, req.previous_response_id)
        conv = None if prev is None else await state.store.get_conversation(org_id, prev.conversation_id)
        if prev is None or conv is None:
            raise not_found(f"No response found with id '{req.previous_response_id}'.", param="previous_response_id")
        if prev.status in UNFINISHED:
            raise bad_request(
                "previous_response_id names a background response that has not finished yet.",
                param="previous_response_id",
            )
        if len(conv.messages) != prev.num_messages:
            raise bad_request(
                "previous_response_id must be the latest response of its conversation; branching "
                "from an earlier one is not supported.",
                param="previous_response_id",
            )
        conversation_id = conv.id
        if not req.store:  # continue without storing: the history goes in as messages
            history = tuple(attachments.history_message(m) for m in conv.messages)
            return replace(req, chat=replace(req.chat, messages=history + req.chat.messages)), None
    if not req.store:
        return req, None
    created = None
    if conversation_id is None:
        first = next((m.content for m in req.chat.messages if m.role == "user"), "")
        conversation_id = created = (await state.store.create_conversation(org_id, title=title_from(first))).id
    return replace(req, chat=replace(req.chat, conversation_id=conversation_id)), created


async def _serve(ctx: _Context, request: web.Request, state: AppState, job: Job, grant: Pass) -> web.StreamResponse:
    if job.chat.stream:
        return await _serve_stream(ctx, request, state, job, grant)
    return await _serve_unary(ctx, request, state, job, grant)


async def _serve_unary(ctx: _Context, request: web.Request, state: AppState, job: Job, grant: Pass) -> web.Response:
    answer = make_answer(job)
    (finish,) = await generate_unary(request, state, job, grant, [answer])
    body = await _finished(ctx, state, job, answer, finish)
    return web.json_response(body, headers=state.response_headers(job), dumps=_dumps)


async def _finished(ctx: _Context, state: AppState, job: Job, answer: Answer, finish: FinishReason) -> dict:
    """The final response object, stored (when asked) before the client sees it."""
    reason = _INCOMPLETE.get(finish)
    body = response_object(
        ctx.response_id,
        ctx.created,
        job.model.name,
        ctx.req,
        {
            "status": "incomplete" if reason else "completed",
            "incomplete_details": {"reason": reason} if reason else None,
            "output": output_items(answer, ctx.message_id),
            "usage": usage_object(job.num_prompt_tokens, job.num_cached_tokens, job.num_completion_tokens),
        },
    )
    conversation_id = job.chat.conversation_id
    if ctx.req.store and conversation_id is not None:
        org_id = job.principal.org.id
        conv = await state.store.get_conversation(org_id, conversation_id)
        num_messages = len(conv.messages) if conv is not None else 0
        if ctx.stored:  # a background response: its row exists since it was queued
            await state.store.update_response(
                org_id, ctx.response_id, status=body["status"], body_json=_dumps(body), num_messages=num_messages
            )
        else:
            await _insert(ctx, state, job, body, num_messages)
    return body


async def _insert(ctx: _Context, state: AppState, job: Job, body: dict, num_messages: int) -> None:
    items = [{"id": new_id("msg"), **item} for item in ctx.req.input_items]
    assert job.chat.conversation_id is not None
    await state.store.insert_response(
        job.principal.org.id,
        StoredResponse(
            ctx.response_id,
            job.chat.conversation_id,
            num_messages,
            _dumps(body),
            _dumps(items),
            time.time(),
            body["status"],
        ),
    )
    ctx.stored = True


class _EventStream:
    """OpenAI's Responses stream events, numbered, for one message item and its function calls."""

    def __init__(self, ctx: _Context, writer: SSEWriter):
        self._ctx, self._writer = ctx, writer
        self._seq = itertools.count()
        self._num_items = 0
        self._text_index: int | None = None  # output_index of the message item once opened
        self._text = ""
        self._logprobs: list[dict] = []  # of the text sent so far (when `include` asked for them)
        self._pending: list[dict] = []  # logprobs that came with no text (held for the next text delta)

    async def event(self, kind: str, **fields) -> None:
        await self._writer.data({"type": kind, "sequence_number": next(self._seq), **fields})

    async def delta(self, d: dict) -> None:
        delta = d["delta"]
        if d.get("logprobs"):
            self._pending += d["logprobs"]["content"]
        if delta.get("content"):
            await self._text_delta(delta["content"])
        for call in delta.get("tool_calls", []):
            await self._call(call)

    async def _text_delta(self, text: str) -> None:
        await self._open_text()
        self._text += text
        entries, self._pending = self._pending, []
        self._logprobs += entries
        await self.event(
            "response.output_text.delta",
            item_id=self._ctx.message_id,
            output_index=self._text_index,
            content_index=0,
            delta=text,
            logprobs=event_logprobs(entries),
        )

    async def _open_text(self) -> None:
        if self._text_index is not None:
            return
        self._text_index = self._next_index()
        item = message_item(self._ctx.message_id, "", "in_progress")
        await self.event("response.output_item.added", output_index=self._text_index, item=item)
        await self.event(
            "response.content_part.added",
            item_id=self._ctx.message_id,
            output_index=self._text_index,
            content_index=0,
            part=output_text_part(""),
        )

    async def _call(self, raw: dict) -> None:
        call = ToolCall(raw["id"], raw["function"]["name"], raw["function"]["arguments"])
        index, item = self._next_index(), function_call_item(call, "in_progress")
        await self.event("response.output_item.added", output_index=index, item=item)
        await self.event(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=call.arguments
        )
        await self.event(
            "response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=call.arguments
        )
        await self.event("response.output_item.done", output_index=index, item=function_call_item(call, "completed"))

    async def close_text(self, has_calls: bool) -> None:
        if self._text_index is None and has_calls:
            return
        await self._open_text()
        if self._pending:  # logprobs of tokens whose text never came (held back, or none)
            await self._text_delta("")
        mid, index = self._ctx.message_id, self._text_index
        part = output_text_part(self._text, self._logprobs)
        await self.event(
            "response.output_text.done",
            item_id=mid,
            output_index=index,
            content_index=0,
            text=self._text,
            logprobs=event_logprobs(self._logprobs),
        )
        await self.event("response.content_part.done", item_id=mid, output_index=index, content_index=0, part=part)
        await self.event(
            "response.output_item.done",
            output_index=index,
            item=message_item(mid, self._text, "completed", self._logprobs),
        )

    def _next_index(self) -> int:
        self._num_items += 1
        return self._num_items - 1


async def _serve_stream(
    ctx: _Context, request: web.Request, state: AppState, job: Job, grant: Pass
) -> web.StreamResponse:
    stream = LazyStream(request, lambda: state.response_headers(job))
    answer = make_answer(job)
    events: _EventStream | None = None

    async def emit(text, logprobs) -> None:
        assert events is not None  # tokens flow only once the stream is open
        for d in answer.feed(text, logprobs):
            await events.delta(d)

    async def run() -> None:
        nonlocal events
        await wait_admitted(state, grant, job, stream.comment)
        events = _EventStream(ctx, await stream.open())
        started = response_object(ctx.response_id, ctx.created, job.model.name, ctx.req, {})
        await events.event("response.created", response=started)
        await events.event("response.in_progress", response=started)
        (finish,) = await generate_choices(state, job, [emit], stream.comment)
        for d in answer.close():
            await events.delta(d)
        await events.close_text(bool(answer.tool_calls))
        await finish_job(state, job, STATUS[finish], finish)
        body = await _finished(ctx, state, job, answer, finish)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        await events.event(kind, response=body)
        await (await stream.open()).done()

    return await stream_job(request, state, job, grant, stream, run)


async def _refuse(ctx: _Context, request: web.Request, state: AppState, job: Job, verdict) -> web.StreamResponse:
    """A prompt blocked before the engine: an incomplete response carrying the refusal text."""
    assert state.safety is not None  # only the safety gate blocks a prompt
    refusal = state.safety.refusal_text(verdict)
    if state.settings.safety.block_mode == "error":
        await finish_job(
            state, job, RequestStatus.FILTERED, FinishReason.CONTENT_FILTER, prompt_billed=False, store_answer=False
        )
        raise ApiError(
            400,
            "The prompt was blocked by the content policy.",
            "invalid_request_error",
            "content_policy_violation",
            "input",
        )
    job.text_parts = [refusal]
    await finish_job(state, job, RequestStatus.FILTERED, FinishReason.CONTENT_FILTER, prompt_billed=False)
    answer = make_answer(job)
    answer.feed(refusal)
    body = await _finished(ctx, state, replace_usage(job), answer, FinishReason.CONTENT_FILTER)
    if not job.chat.stream:
        return web.json_response(body, headers=state.response_headers(job), dumps=_dumps)
    writer = await LazyStream(request, lambda: state.response_headers(job)).open()
    events = _EventStream(ctx, writer)
    await events.event("response.created", response={**body, "status": "in_progress", "output": [], "usage": None})
    await events.event("response.incomplete", response=body)
    await writer.done()
    return writer._response


def replace_usage(job: Job) -> Job:
    """A refused prompt is not billed: its response reports zero tokens."""
    job.reported_prompt_tokens, job.num_cached_tokens, job.num_completion_tokens = 0, 0, 0
    return job


# ---- background: true -----------------------------------------------------------------------


async def _start_background(
    request: web.Request, state: AppState, grant: Pass, ctx: _Context, owned: tuple[contextlib.ExitStack, str | None]
) -> web.Response:
    """Serve the job in a task that owns the grant; answer `queued` as soon as the job is in the
    queue (its row stored first), or with the error that refused it before (a 4xx, as in the foreground)."""
    accepted: asyncio.Future[tuple[dict, dict]] = asyncio.get_running_loop().create_future()
    outlet = Outlet(
        serve=functools.partial(_serve_background, ctx, accepted),
        refuse=functools.partial(_refuse_background, ctx, accepted),
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
    return web.json_response(body, headers=headers, dumps=_dumps)


async def _run_background(
    request: web.Request,
    state: AppState,
    grant: Pass,
    ctx: _Context,
    outlet: Outlet,
    owned: tuple[contextlib.ExitStack, str | None],
) -> None:
    stack, new_conversation = owned
    with stack:  # the admission grant: its one release, whatever happens below
        try:
            await serve_job(request, state, grant, ctx.req.chat, outlet)
        finally:
            if new_conversation is not None and not ctx.stored:  # refused before it was queued
                await asyncio.shield(state.store.delete_conversation(request[PRINCIPAL].org.id, new_conversation))


def _forget(running: dict, key: tuple[str, str], accepted: asyncio.Future, task: asyncio.Task) -> None:
    running.pop(key, None)
    if not task.cancelled() and task.exception() is not None and accepted.done():
        log.error("background_response_failed", response_id=key[1], error=repr(task.exception()))


async def _serve_background(
    ctx: _Context, accepted: asyncio.Future, request: web.Request, state: AppState, job: Job, grant: Pass
) -> web.Response:
    """Runs inside the in-flight set (shutdown waits for it, then cuts it): queued -> in_progress -> final."""
    queued = response_object(ctx.response_id, ctx.created, job.model.name, ctx.req, {"status": "queued"})
    conversation_id = job.chat.conversation_id
    conv = (
        None if conversation_id is None else await state.store.get_conversation(job.principal.org.id, conversation_id)
    )
    await _insert(ctx, state, job, queued, len(conv.messages) if conv is not None else 0)
    accepted.set_result((queued, state.response_headers(job)))
    answer = make_answer(job)
    try:
        await wait_admitted(state, grant, job, None)
        await _set_state(ctx, state, job, {"status": "in_progress"})
        (finish,) = await generate_unary(request, state, job, grant, [answer])
        if finish is FinishReason.ABORT:  # the engine stopped it (shutdown): not an answer
            await _fail(ctx, state, job, STOPPED_ERROR)
        else:
            await _finished(ctx, state, job, answer, finish)
    except asyncio.CancelledError:
        if request.app[INFLIGHT].was_cut() or state.draining:  # shutdown cut it (or stopped it, below)
            _uncancel_current_task()
            await _fail(ctx, state, job, STOPPED_ERROR)
        else:  # POST /v1/responses/{id}/cancel (or its DELETE)
            _uncancel_current_task()
            await finish_quietly(state, job, RequestStatus.ABORTED, FinishReason.ABORT)
            await _set_state(ctx, state, job, {"status": "cancelled", "usage": _usage(job)})
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
    ctx: _Context, accepted: asyncio.Future, request: web.Request, state: AppState, job: Job, verdict
) -> web.Response:
    """A prompt the safety gate blocks: stored as the foreground stores it, then answered (not queued)."""
    response = await _refuse(ctx, request, state, job, verdict)  # block_mode "error": a 400, nothing stored
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)  # JSON: background never streams
    accepted.set_result((orjson.loads(response.body), state.response_headers(job)))
    return response


async def _fail(ctx: _Context, state: AppState, job: Job, error: dict) -> None:
    await finish_quietly(state, job, RequestStatus.ERROR, None)
    await _set_state(ctx, state, job, {"status": "failed", "error": error, "usage": _usage(job)})


async def _set_state(ctx: _Context, state: AppState, job: Job, fields: dict) -> None:
    """Update the stored row of a running background response (no-op once it is final or deleted)."""
    body = {**response_object(ctx.response_id, ctx.created, job.model.name, ctx.req, fields), **fields}
    try:
        await asyncio.shield(
            state.store.update_response(
                job.principal.org.id, ctx.response_id, status=body["status"], body_json=_dumps(body)
            )
        )
    except StoreUnavailable:  # the store says so in its log; a restart marks it failed
        log.error("background_response_unsaved", response_id=ctx.response_id, status=body["status"])


def _usage(job: Job) -> dict:
    return usage_object(job.num_prompt_tokens, job.num_cached_tokens, job.num_completion_tokens)


async def cancel_response(request: web.Request) -> web.Response:
    """Cancel a background response; one that already finished is returned as it is."""
    stored = await _stored(request)
    if not orjson.loads(stored.body_json).get("background"):
        raise bad_request("Only a response created with background=true can be cancelled.", param="response_id")
    if await _stop_background(request, stored.id):
        stored = await _stored(request)
    return web.json_response(text=stored.body_json)


async def _stop_background(request: web.Request, response_id: str) -> bool:
    """Cancel this org's running background response and wait for its final row; False if none ran."""
    task = request.app[BACKGROUND].get((request[PRINCIPAL].org.id, response_id))
    if task is None or task.done():
        return False
    task.cancel()
    await asyncio.wait({task}, timeout=30.0)
    return True


async def get_response(request: web.Request) -> web.Response:
    stored = await _stored(request)
    return web.json_response(text=stored.body_json)


async def delete_response(request: web.Request) -> web.Response:
    state, response_id = request.app[STATE], request.match_info["response_id"]
    await _stop_background(request, response_id)  # a deleted response is not served on
    if not await state.store.delete_response(request[PRINCIPAL].org.id, response_id):
        raise _response_not_found(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    items = orjson.loads((await _stored(request)).input_items_json)
    return web.json_response(
        {
            "object": "list",
            "data": items,
            "has_more": False,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
        },
        dumps=_dumps,
    )


async def _stored(request: web.Request) -> StoredResponse:
    state, response_id = request.app[STATE], request.match_info["response_id"]
    stored = await state.store.get_response(request[PRINCIPAL].org.id, response_id)
    if stored is None:
        raise _response_not_found(response_id)
    return stored


def _response_not_found(response_id: str) -> ApiError:
    return not_found(f"No response found with id '{response_id}'.", param="response_id")


def _dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()


async def _stop_all_background(app: web.Application) -> None:
    """At shutdown, after the in-flight drain: stop what is left, so each row says `failed`
    while the store is still open (a crash leaves that to the next start)."""
    tasks = [t for t in app[BACKGROUND].values() if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=10.0)


def add_routes(app: web.Application) -> None:
    app[BACKGROUND] = {}
    app.on_shutdown.append(_stop_all_background)  # after app.py's, which sets `draining`
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
