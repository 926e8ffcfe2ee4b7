"""The Responses API: POST /v1/responses, GET/DELETE /v1/responses/{id}, GET .../input_items,
POST /v1/responses/input_tokens.

A response is served by the chat completions' request path (`chat.serve_job`: routing, budget,
context, safety, admission, priority queue, generation, billing); only its rendering differs.
With `store` (the default) it is a turn of a conversation in the caller's organisation (the web
UI lists it, retention purges it) plus a row with the response object; `previous_response_id`
continues that conversation (from an earlier response than its latest: a copy of it), so the
prompt's prefix is in the KV cache. `instructions` go first and are never stored with the turn.
GET with `stream=true` replays a finished response as its stream's events. Other orgs get 404.
`background: true` answers `queued` at once and serves the same path in a task that owns the
admission grant (released there, once); the stored row follows it to completed, failed or cancelled.

This module parses and serves a request in the foreground and holds the routes; the rest is in
responses_background.py (the background lifecycle), responses_record.py (the response object
and its stored row), responses_stream.py (the stream's events) and responses_wire.py (the wire
format).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import replace

import orjson
from aiohttp import web

from api import attachments, chat_bodies
from api.chat import Outlet, json_dumps, parse_body, read_json, serve_job
from api.errors import ApiError, bad_request, not_found, overloaded
from api.finish import STATUS, finish_job, generate_unary, stream_job
from api.generation import generate_choices, make_answer
from api.job import Job
from api.paging import list_body, page_limit, page_order
from api.protocol import ChatMessage, ChatRequest
from api.responses_background import BACKGROUND, start_background, stop_all_background, stop_background
from api.responses_record import ResponseContext, body_of, dumps, finished, record_cut
from api.responses_stream import FINAL_EVENT, EventStream, replay
from api.responses_wire import ResponsesRequest, input_error, input_item_object, new_id, parse_responses_request
from api.sse import SSE_HEADERS, SSEWriter
from api.state import PRINCIPAL, REQUEST_ID, STATE, AppState
from api.token_count import charge_one_request, count_as_served, model_to_count_for
from api.waiting import LazyStream, wait_admitted
from engine.types import FinishReason
from gateway.admission import Pass
from store.conversations import title_from
from store.responses import UNFINISHED, StoredResponse
from store.types import Conversation, Message, RequestStatus


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
        req = await parse_body(
            functools.partial(
                parse_responses_request, max_messages=cfg.max_messages, max_prompt_chars=cfg.max_prompt_chars
            ),
            await read_json(request),
            num_bytes=num_bytes,
        )
        org_id = request[PRINCIPAL].org.id
        ctx = await _context(state, org_id, req, owned)
        try:
            if req.background:  # the grant goes to the task that serves it
                return await start_background(request, state, grant, ctx, owned.pop_all(), _refuse)
            outlet = Outlet(serve=functools.partial(_serve, ctx), refuse=functools.partial(_refuse, ctx))
            try:
                return await serve_job(request, state, grant, ctx.req.chat, outlet)
            finally:
                if ctx.new_conversation is not None and not ctx.stored:  # refused before an answer: no trace
                    await asyncio.shield(state.store.discard_pending_conversation(org_id, ctx.new_conversation))
        except ApiError as exc:  # name the field as this request spelled it
            raise input_error(exc, num_history=ctx.num_inline_messages) from None


async def _context(state: AppState, org_id: str, req: ResponsesRequest, owned: contextlib.ExitStack) -> ResponseContext:
    """The response's prompt (instructions, the history of previous_response_id, the input) and
    the conversation its turn goes into: the previous response's, a copy of the previous
    response's part of it when that is not the latest (a branch), or a new one. A turn that goes
    into the previous response's conversation holds it (api/turn_lock.py) until `owned` closes.
    One that finds a turn running there branches at once: that turn will come after the response
    it continues, as it would had it arrived later (two continuations of the latest response at
    once make one turn and one branch, never two turns in a row)."""
    history: tuple[Message, ...] = ()
    conversation_id = created = None
    if req.previous_response_id is not None:
        release = None
        if req.store:
            named = await state.store.get_response(org_id, req.previous_response_id)
            if named is None:
                raise _previous_gone(req.previous_response_id)
            release = state.turn_locks.try_acquire(org_id, named.conversation_id)
            if release is not None:
                owned.callback(release)
        prev, conv = await _previous(state, org_id, req.previous_response_id)
        history = conv.messages[: prev.num_messages]
        if req.store and release is not None and len(conv.messages) == prev.num_messages:
            conversation_id = conv.id
        elif req.store:  # an earlier response (a retry, a second answer, one after a deleted one), or a turn runs
            branch = await state.store.branch_conversation(org_id, conv.id, prev.num_messages, pending=True)
            if release is not None:  # the copy is made: the original conversation is free again
                release()
            if branch is None:  # deleted or cut meanwhile
                raise _previous_gone(req.previous_response_id)
            conversation_id = created = branch.id
    elif req.store:
        first = next((m.content for m in req.chat.messages if m.role == "user"), "")
        conversation_id = created = (
            await state.store.create_conversation(org_id, title=title_from(first), pending=True)
        ).id
    chat = replace(_prompt_chat(req, history, is_stored=conversation_id is not None), conversation_id=conversation_id)
    return ResponseContext(
        replace(req, chat=chat),
        new_id("resp"),
        chat_bodies.now_s(),
        new_id("msg"),
        num_history_messages=len(history),
        num_inline_messages=chat.num_history_messages,
        new_conversation=created,
    )


def _prompt_chat(req: ResponsesRequest, history: tuple[Message, ...], *, is_stored: bool) -> ChatRequest:
    """The request as the chat request path takes it: the instructions first, then the input.
    Stored: the request path loads the conversation's history itself (trimmed to fit the context,
    files and images as notes). Not stored: the history goes in with the input, whole."""
    inline = () if is_stored else tuple(attachments.history_message(m) for m in history)
    return replace(
        req.chat,
        messages=inline + req.chat.messages,
        instructions=(ChatMessage("system", req.instructions),) if req.instructions else (),
        num_history_messages=len(inline),
    )


async def count_input_tokens(request: web.Request) -> web.Response:
    """POST /v1/responses/input_tokens (OpenAI's): the tokens the request's prompt would take
    (its instructions, the history of previous_response_id, its input and tools) as this server
    renders it for the model and fits it to the context (a stored history's oldest turns dropped,
    files cut per `truncation`; what the request would refuse as too long is the same 400), as
    `{"object": "response.input_tokens", "input_tokens": N}`: the response's usage.input_tokens.
    Nothing is generated, stored or billed; one request against the per-minute limit."""
    headers = charge_one_request(request)
    state = request.app[STATE]
    cfg = state.settings.server
    req = parse_responses_request(
        await read_json(request), max_messages=cfg.max_messages, max_prompt_chars=cfg.max_prompt_chars
    )
    model = model_to_count_for(request, req.chat.model)
    history: tuple[Message, ...] = ()
    if req.previous_response_id is not None:
        prev, conv = await _previous(state, request[PRINCIPAL].org.id, req.previous_response_id)
        history = conv.messages[: prev.num_messages]
    chat = _prompt_chat(req, history, is_stored=req.store)  # as _context: stored iff `store`
    stored = tuple(attachments.history_message(m) for m in history) if req.store else None
    try:
        num_tokens = await count_as_served(request, model, chat, stored)
    except ApiError as exc:  # name the field as this request spelled it
        raise input_error(exc, num_history=chat.num_history_messages) from None
    body = {"object": "response.input_tokens", "input_tokens": num_tokens}
    return web.json_response(body, dumps=json_dumps, headers=headers)


async def _previous(state: AppState, org_id: str, response_id: str) -> tuple[StoredResponse, Conversation]:
    """The response to continue and its conversation, holding at least that response's messages."""
    prev = await state.store.get_response(org_id, response_id)
    conv = None if prev is None else await state.store.get_conversation(org_id, prev.conversation_id)
    if prev is None or conv is None:
        raise _previous_gone(response_id)
    if prev.status in UNFINISHED:
        raise bad_request(
            "previous_response_id names a background response that has not finished yet.",
            param="previous_response_id",
        )
    if len(conv.messages) < prev.num_messages:  # the web UI cut the conversation back (regenerate, edit)
        raise bad_request(
            "The conversation of previous_response_id was cut back since; that response's history is gone.",
            param="previous_response_id",
        )
    return prev, conv


def _previous_gone(response_id: str) -> ApiError:
    return not_found(f"No response found with id '{response_id}'.", param="previous_response_id")


async def _serve(
    ctx: ResponseContext, request: web.Request, state: AppState, job: Job, grant: Pass
) -> web.StreamResponse:
    if job.chat.stream:
        return await _serve_stream(ctx, request, state, job, grant)
    return await _serve_unary(ctx, request, state, job, grant)


async def _serve_unary(
    ctx: ResponseContext, request: web.Request, state: AppState, job: Job, grant: Pass
) -> web.Response:
    answer = make_answer(job)
    try:
        (finish,) = await generate_unary(request, state, job, grant, [answer])
    except asyncio.CancelledError:  # the client left
        await record_cut(ctx, state, job, answer, None)
        raise
    except ApiError as exc:  # shutdown, an engine failure: the error is the answer, the row says failed
        await record_cut(ctx, state, job, answer, exc)
        raise
    body = await finished(ctx, state, job, answer, finish)
    return web.json_response(body, headers=state.response_headers(job), dumps=dumps)


async def _serve_stream(
    ctx: ResponseContext, request: web.Request, state: AppState, job: Job, grant: Pass
) -> web.StreamResponse:
    stream = LazyStream(request, lambda: state.response_headers(job))
    answer = make_answer(job)
    events: EventStream | None = None

    async def emit(text, logprobs) -> None:
        assert events is not None  # tokens flow only once the stream is open
        for d in answer.feed(text, logprobs):
            await events.delta(d)

    async def run() -> None:
        nonlocal events
        await wait_admitted(state, grant, job, stream.comment)
        events = EventStream(ctx.message_id, await stream.open())
        started = body_of(ctx, job, {})
        await events.event("response.created", response=started)
        await events.event("response.in_progress", response=started)
        (finish,) = await generate_choices(state, job, [emit], stream.comment)
        for d in answer.close():
            await events.delta(d)
        await events.close_text(bool(answer.tool_calls))
        await finish_job(state, job, STATUS[finish], finish)
        body = await finished(ctx, state, job, answer, finish)
        await events.event(FINAL_EVENT[body["status"]], response=body)
        await (await stream.open()).done()

    async def render_error(writer: SSEWriter, error: ApiError) -> None:
        """A stream cut by the server ends as a failed response (stored so, with `store`)."""
        nonlocal events
        body = await record_cut(ctx, state, job, answer, error)
        if events is None:  # cut before the response was announced
            events = EventStream(ctx.message_id, writer)
            await events.event("response.created", response=body_of(ctx, job, {}))
        await events.event("response.failed", response=body)

    try:
        return await stream_job(request, state, job, grant, stream, run, render_error)
    except asyncio.CancelledError:  # the client left
        await record_cut(ctx, state, job, answer, None)
        raise
    except ApiError as exc:  # cut while still queued (shutdown): a plain 503, the row says failed
        await record_cut(ctx, state, job, answer, exc)
        raise


async def _refuse(ctx: ResponseContext, request: web.Request, state: AppState, job: Job, verdict) -> web.StreamResponse:
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
    body = await finished(ctx, state, replace_usage(job), answer, FinishReason.CONTENT_FILTER)
    if not job.chat.stream:
        return web.json_response(body, headers=state.response_headers(job), dumps=dumps)
    writer = await LazyStream(request, lambda: state.response_headers(job)).open()
    events = EventStream(ctx.message_id, writer)
    await events.event("response.created", response={**body, "status": "in_progress", "output": [], "usage": None})
    await events.event("response.incomplete", response=body)
    await writer.done()
    return writer.response


def replace_usage(job: Job) -> Job:
    """A refused prompt is not billed: its response reports zero tokens."""
    job.reported_prompt_tokens, job.num_cached_tokens, job.num_completion_tokens = 0, 0, 0
    job.reasoning_tokens_by_choice = []
    return job


async def cancel_response(request: web.Request) -> web.Response:
    """Cancel a background response; one that already finished is returned as it is."""
    stored = await _stored(request)
    if not orjson.loads(stored.body_json).get("background"):
        raise bad_request("Only a response created with background=true can be cancelled.", param="response_id")
    if await stop_background(request, stored.id):
        stored = await _stored(request)
    return web.json_response(text=stored.body_json)


async def get_response(request: web.Request) -> web.StreamResponse:
    """The stored response; `stream=true` replays a finished one as its stream's events."""
    stream = request.query.get("stream", "false")
    if stream not in ("true", "false"):
        raise bad_request(f"'stream' must be true or false, got {stream!r}.", param="stream")
    if "starting_after" in request.query:  # resuming needs the live numbering, which a replay does not keep
        raise bad_request(
            "'starting_after' is not supported: a replay sends the text as one delta, so its events are "
            "numbered afresh and do not line up with the live stream's. Replay the whole response instead.",
            param="starting_after",
            code="unsupported_value",
        )
    stored = await _stored(request)
    if stream == "false":
        return web.json_response(text=stored.body_json)
    if stored.status in UNFINISHED:
        raise bad_request(
            "This background response has not finished; streaming it while it runs is not supported here: "
            "poll GET /v1/responses/{id} without 'stream'.",
            param="stream",
            code="unsupported_value",
        )
    events = await replay(orjson.loads(stored.body_json))
    frames = [b"data: " + orjson.dumps(event) + b"\n\n" for event in events]
    return web.Response(body=b"".join(frames) + b"data: [DONE]\n\n", headers=SSE_HEADERS)  # as a live stream ends


async def delete_response(request: web.Request) -> web.Response:
    state, response_id = request.app[STATE], request.match_info["response_id"]
    await stop_background(request, response_id)  # a deleted response is not served on
    if not await state.store.delete_response(request[PRINCIPAL].org.id, response_id):
        raise _response_not_found(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    """A page of the response's input items, as OpenAI pages them: `limit` 1-100 (20), `order`
    desc (newest first, the default) or asc, `after` an item id of the previous page."""
    query = request.query
    limit, order = page_limit(query, default=20, maximum=100), page_order(query)
    items = [input_item_object(item) for item in orjson.loads((await _stored(request)).input_items_json)]
    if order == "desc":
        items.reverse()
    start = 0
    if (after := query.get("after")) is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise not_found(f"No input item found with id '{after}' (the 'after' cursor).", param="after")
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return web.json_response(list_body(page, start + len(page) < len(items)), dumps=dumps)


async def _stored(request: web.Request) -> StoredResponse:
    state, response_id = request.app[STATE], request.match_info["response_id"]
    stored = await state.store.get_response(request[PRINCIPAL].org.id, response_id)
    if stored is None:
        raise _response_not_found(response_id)
    return stored


def _response_not_found(response_id: str) -> ApiError:
    return not_found(f"No response found with id '{response_id}'.", param="response_id")


def add_routes(app: web.Application) -> None:
    app[BACKGROUND] = {}
    app.on_shutdown.append(stop_all_background)  # after app.py's, which sets `draining`
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/responses/input_tokens", count_input_tokens)  # before the {response_id} routes
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
