"""The small resource handlers (models, conversations, usage, health, the web UI) and their routes.

`add_routes` registers them, chat completions (`api/chat.py`), feedback and share links
(`api/shares.py`); files and Responses register theirs in `api/files.py` and `api/responses.py`.
Everything here is a thin shell over the store and the app state: parse query/body, call one
store method, render one JSON shape.
"""

from __future__ import annotations

import calendar
import contextlib
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, overload

from aiohttp import web

from api import branch as branch_api
from api import conversation_import
from api import export as export_api
from api import feedback as feedback_api
from api import shares as shares_api
from api.chat import read_json
from api.conversation_objects import conversation_obj, read_conversation
from api.errors import ApiError, bad_request, not_found
from api.fields import MAX_TITLE_CHARS, check_metadata
from api.image_job import prompter_of
from api.model_info import created_at, model_extras
from api.paging import list_body, page_limit
from api.state import PRINCIPAL, SETTINGS, STATE
from engine.registry import ModelHandle
from engine.tokenizer import Tokenizer
from store import money
from store.conversations import new_message_id
from store.feedback import FeedbackChange
from store.types import ConversationHit, Message, NotFound

MAX_INITIAL_ITEMS = 20  # OpenAI's: items added to a conversation at a time
MAX_SEARCH_CHARS = 200  # GET /v1/conversations?q=: the longest text searched for
_CREATE_FIELDS = ("title", "items", "metadata")  # POST /v1/conversations: OpenAI's items and metadata, our title
_ITEM_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _json(body: object, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


# -- health ----------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    """Liveness: 503 once a model's engine is dead for good (`Backend.health`), which only a
    restart mends, so a supervisor's probe restarts the server rather than leaving it answering
    503 forever. Not while draining: the process is on its way out then anyway."""
    state = request.app.get(STATE)
    if state is not None and not state.draining and not all(h.backend.health() for h in state.models.values()):
        return _json({"status": "engine_dead"}, status=503)
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app.get(STATE)
    checks = {
        "models_loaded": state is not None and all(h.backend.health() for h in state.models.values()),
        "not_draining": state is not None and not state.draining,
        "store_writable": state is not None and state.store.is_writable,
    }
    ok = all(checks.values())
    return _json({"status": "ready" if ok else "not_ready", "checks": checks}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


# -- models ----------------------------------------------------------------------------
def _model_obj(name: str, state=None) -> dict:
    obj = {"id": name, "object": "model", "created": 0, "owned_by": "selfhosted"}
    handle = state.models.get(name) if state is not None else None
    if handle is not None:  # extensions: context length, the card's description and examples
        obj["created"] = created_at(handle.config.path) if handle.config.path else 0
        obj.update(model_extras(handle.config.path, handle.max_model_len))
        reasoning = _reasoning(handle)
        if reasoning is not None:
            obj["reasoning"] = reasoning
        if not handle.serves_chat:  # a base model: /v1/completions only
            obj["chat"] = False
        obj["vision"] = prompter_of(handle) is not None  # whether its chat messages may carry images
        loaded = getattr(handle.backend, "is_loaded", None)  # a model loaded on demand (idle_unload_s)
        if isinstance(loaded, bool):
            obj["loaded"] = loaded
    return obj


def _reasoning(handle: ModelHandle) -> dict | None:
    """Extension: for a model served here that thinks in <think> tags, whether this server can
    cap its thinking (thinking_token_budget); the web UI offers its thinking choices from it."""
    tokenizer = handle.tokenizer
    if not isinstance(tokenizer, Tokenizer) or not tokenizer.thinks:
        return None
    return {"thinking_token_budget": handle.thinking_tags is not None}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tier_name, _ = state.tier_of(request[PRINCIPAL])
    names = state.admission.router.models_for_tier(tier_name)
    return _json({"object": "list", "data": [_model_obj(n, state) for n in names]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tier_name, _ = state.tier_of(request[PRINCIPAL])
    name = request.match_info["model"]
    if name not in state.admission.router.models_for_tier(tier_name):
        raise not_found(f"The model '{name}' does not exist or you do not have access to it.", code="model_not_found")
    return _json(_model_obj(name, state))


# -- conversations -----------------------------------------------------------------------
@overload
def _title(body: object, *, required: Literal[True]) -> str: ...
@overload
def _title(body: object, *, required: bool) -> str | None: ...
def _title(body: object, *, required: bool) -> str | None:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    title = body.get("title")
    if title is None and not required:
        return None
    if not isinstance(title, str) or not title.strip():
        raise bad_request("'title' must be a non-empty string.", param="title")
    if len(title) > MAX_TITLE_CHARS:
        raise bad_request(f"'title' may have at most {MAX_TITLE_CHARS} characters, got {len(title)}.", param="title")
    return title.strip()


def _conversation_missing(conversation_id: str) -> ApiError:
    return not_found(f"No conversation found with id '{conversation_id}'.", param="conversation_id")


async def create_conversation(request: web.Request) -> web.Response:
    """OpenAI's `items` (its first messages) and `metadata`, and our `title`; all optional."""
    body = await read_json(request) if request.body_exists else {}
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    title = _title(body, required=False)
    for key in body:
        if key not in _CREATE_FIELDS:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    check_metadata(body.get("metadata"))
    server = request.app[STATE].settings.server
    messages = _initial_messages(
        body.get("items"), min(MAX_INITIAL_ITEMS, server.max_messages), server.max_prompt_chars
    )
    state = request.app[STATE]
    await state.check_conversation_storage(request[PRINCIPAL], sum(len(m.content) for m in messages))
    conv = await state.store.create_conversation(
        request[PRINCIPAL].org.id, title=title, metadata=body.get("metadata"), messages=messages
    )
    return _json(conversation_obj(conv, with_messages=True), status=201)


def _initial_messages(items: object, max_items: int, max_chars: int) -> tuple[Message, ...]:
    """Message items (user, assistant, system or developer; text as a string or text parts), at
    most `max_items` (OpenAI's 20) holding at most `max_chars` characters, as one request's prompt."""
    if items is None:
        return ()
    if not isinstance(items, list) or len(items) > max_items:
        raise bad_request(f"'items' must be an array of at most {max_items} message items.", param="items")
    now = time.time()
    messages = tuple(Message(new_message_id(), *_item(item, f"items[{i}]"), now) for i, item in enumerate(items))
    total = sum(len(m.content) for m in messages)
    if total > max_chars:
        raise bad_request(
            f"'items' hold {total} characters; the limit is {max_chars} (server.max_prompt_chars).",
            param="items",
            code="context_length_exceeded",
        )
    return messages


def _item(item: object, where: str) -> tuple[str, str]:
    """(role, text) of one message item; anything else is a 400 naming where it is."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise bad_request(f"'{where}' must be a message item.", param=where)
    role, content = item.get("role"), item.get("content")
    if role not in _ITEM_ROLES:
        raise bad_request(
            f"'{where}.role' must be one of {', '.join(_ITEM_ROLES)}; got {role!r}.", param=f"{where}.role"
        )
    if isinstance(content, str):
        return role, content
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or an array of text parts.", param=f"{where}.content")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"'{where}.content[{j}]' must be an input_text or output_text part.", param=f"{where}.content[{j}]"
            )
    return role, "".join(part["text"] for part in content)


async def list_conversations(request: web.Request) -> web.Response:
    """The organisation's conversations, newest first, a page at a time; with `q` (ours), only
    those whose title or messages contain that text, each with `message_id` and `snippet`."""
    limit = page_limit(request.query, default=20, maximum=100)
    after = request.query.get("after")
    text = _search_text(request.query)
    store, org_id = request.app[STATE].store, request[PRINCIPAL].org.id
    try:
        if text:
            hits, has_more = await store.search_conversations(org_id, text, limit=limit, after=after)
            data = [_hit_obj(h) for h in hits]
        else:
            convs, has_more = await store.list_conversations(org_id, limit=limit, after=after)
            data = [conversation_obj(c, with_messages=False) for c in convs]
    except NotFound:
        raise not_found(f"No conversation found with id '{after}' (the 'after' cursor).", param="after") from None
    return _json(list_body(data, has_more))


def _search_text(query: Mapping[str, str]) -> str:
    """`q`: the text to look for, literally (never a query language), spaces at its ends
    dropped; '' when absent or blank (the plain list). Too long, or a NUL, is a 400 naming it."""
    text = query.get("q", "").strip()
    if len(text) > MAX_SEARCH_CHARS:
        raise bad_request(f"'q' may have at most {MAX_SEARCH_CHARS} characters, got {len(text)}.", param="q")
    if "\x00" in text:  # SQLite's FTS5 ends a query string there
        raise bad_request("'q' must not contain a NUL character.", param="q")
    return text


def _hit_obj(hit: ConversationHit) -> dict:
    """A conversation search found, as listed, with the latest message that holds the text and
    that text around the match (plain text; both null when only the title holds it)."""
    return {
        **conversation_obj(hit.conversation, with_messages=False),
        "message_id": hit.message_id,
        "snippet": hit.snippet,
    }


async def get_conversation(request: web.Request) -> web.Response:
    cid = request.match_info["conversation_id"]
    obj = await read_conversation(request.app[STATE].store, request[PRINCIPAL].org.id, cid)
    if obj is None:
        raise _conversation_missing(cid)
    return _json(obj)


async def update_conversation(request: web.Request) -> web.Response:
    """PATCH (ours) or POST (OpenAI's update) /v1/conversations/{id}: `title` and/or `metadata`
    (null or {} clears it)."""
    cid = request.match_info["conversation_id"]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    for key in body:
        if key not in ("title", "metadata"):
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    if not body:
        raise bad_request("Send 'title' or 'metadata' to change.", param="title")
    title = _title(body, required="metadata" not in body)
    check_metadata(body.get("metadata"))
    conv = await request.app[STATE].store.update_conversation(
        request[PRINCIPAL].org.id, cid, title=title, metadata=body.get("metadata"), set_metadata="metadata" in body
    )
    if conv is None:
        raise _conversation_missing(cid)
    return _json(conversation_obj(conv, with_messages=False))


async def delete_conversation(request: web.Request) -> web.Response:
    cid = request.match_info["conversation_id"]
    if not await request.app[STATE].store.delete_conversation(request[PRINCIPAL].org.id, cid):
        raise _conversation_missing(cid)
    request.app[STATE].forget_conversation_bytes(request[PRINCIPAL].org.id)  # room again under its cap
    return _json({"id": cid, "object": "conversation.deleted", "deleted": True})


def _feedback_note(value: object) -> tuple[str, FeedbackChange] | None:
    """The truncate's optional `feedback`: {"message_id": ..., "regenerated": true, "edited_prompt": ...}
    (api/feedback.py's fields) on the answer the cut replaces, recorded only if the cut is made."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("message_id"), str):
        raise bad_request("'feedback' must be an object naming the answer's 'message_id'.", param="feedback")
    return value["message_id"], feedback_api.parse_change({k: v for k, v in value.items() if k != "message_id"})


async def truncate_conversation(request: web.Request) -> web.Response:
    """POST /v1/conversations/{id}/truncate {"keep_messages": N, "expected_last_message_id": id}:
    for edit-and-resend and regenerate. Waits for a turn in progress (api/turn_lock.py); with
    `expected_last_message_id` (the web UI sends it) the cut is made only if the conversation
    still ends with that message, else 409 `conversation_changed`: a turn stored meanwhile (one
    another tab or client was already told is stored) is never cut by a count worked out
    before it. An optional `feedback` note (the regenerate or edit being made) is recorded only
    with the cut."""
    cid = request.match_info["conversation_id"]
    raw = await read_json(request)
    body = raw if isinstance(raw, dict) else {}
    keep = body.get("keep_messages")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise bad_request("'keep_messages' must be a non-negative integer.", param="keep_messages")
    expected = body.get("expected_last_message_id")
    if expected is not None and not isinstance(expected, str):
        raise bad_request("'expected_last_message_id' must be a message id.", param="expected_last_message_id")
    note = _feedback_note(body.get("feedback"))
    state, org_id = request.app[STATE], request[PRINCIPAL].org.id
    release = await state.turn_locks.acquire(org_id, cid, param=None)
    try:
        if expected is not None:
            current = await state.store.get_conversation(org_id, cid)
            if current is None:
                raise _conversation_missing(cid)
            last = current.messages[-1].id if current.messages else None
            if last != expected:
                raise ApiError(
                    409,
                    "The conversation changed since it was read (another tab or client added or removed "
                    "messages); read it again before cutting it.",
                    "invalid_request_error",
                    "conversation_changed",
                    "expected_last_message_id",
                )
        if note is not None:  # on the answer being replaced, only when it is: best effort, as the endpoint's
            with contextlib.suppress(NotFound):
                await state.store.set_feedback(org_id, cid, *note)
        if not await state.store.truncate_conversation(org_id, cid, keep):
            raise _conversation_missing(cid)
    finally:
        release()
    found = await state.store.get_billed_conversation(org_id, cid)
    if found is None:  # deleted since the truncation
        raise _conversation_missing(cid)
    conv, billed = found
    return _json(conversation_obj(conv, with_messages=True, billed=billed))


# -- usage -------------------------------------------------------------------------------
def time_param(request: web.Request, name: str) -> float | None:
    text = request.query.get(name)
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # nan, inf and 1e400 (which float() turns into inf)
        raise bad_request(f"'{name}' must be a unix timestamp in seconds, got {text!r}.", param=name)
    return value


def month_start(now: float | None = None) -> float:
    t = time.gmtime(now if now is not None else time.time())
    return float(calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)))


async def usage(request: web.Request) -> web.Response:
    group_by = request.query.get("group_by", "model")
    if group_by not in ("model", "day", "key"):
        raise bad_request(f"'group_by' must be model, day or key, got {group_by!r}.", param="group_by")
    start = time_param(request, "start")
    end = time_param(request, "end")
    store, org = request.app[STATE].store, request[PRINCIPAL].org
    rows = await store.usage_summary(
        org.id, start=start if start is not None else month_start(), end=end, group_by=group_by
    )
    # The organisation's monthly budget as it is now (the key cache may hold an older copy) and
    # this calendar month's spend against it, whatever start and end asked for.
    current = await store.get_org(org.name) or org
    budget = {"budget_usd": current.budget_usd, "month_spend_usd": await store.month_spend_usd(org.id)}
    return _json({**usage_body(group_by, rows), "budget": budget})


def usage_body(group_by: str, rows: list[dict]) -> dict:
    """The usage object: the ledger's rows per group and their totals."""
    totals = {
        k: sum(r.get(k, 0) or 0 for r in rows)
        for k in ("num_requests", "prompt_tokens", "cached_tokens", "completion_tokens")
    }
    totals["cost_usd"] = money.sum_usd(r.get("cost_usd") for r in rows)  # decimal, not float, addition
    return {"object": "usage", "group_by": group_by, "data": rows, "total": totals}


# -- static UI ---------------------------------------------------------------------------
def _add_static(app: web.Application) -> None:
    static_dir = Path(app[SETTINGS].server.static_dir)
    index = static_dir / "index.html"

    async def ui_index(_request: web.Request) -> web.StreamResponse:
        if not index.exists():
            return web.Response(text="The web UI is not installed (static/index.html missing).", status=404)
        return web.FileResponse(index, headers={"Cache-Control": "no-cache"})

    app.router.add_get("/", ui_index)
    if static_dir.is_dir():
        app.router.add_static("/static/", static_dir, follow_symlinks=False)


def add_routes(app: web.Application, chat_handler) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_handler)
    app.router.add_post("/v1/conversations", create_conversation)
    app.router.add_get("/v1/conversations", list_conversations)
    export_api.add_routes(app)  # these two before /v1/conversations/{conversation_id}
    conversation_import.add_routes(app)
    app.router.add_get("/v1/conversations/{conversation_id}", get_conversation)
    app.router.add_patch("/v1/conversations/{conversation_id}", update_conversation)
    app.router.add_post("/v1/conversations/{conversation_id}", update_conversation)  # OpenAI's update
    app.router.add_delete("/v1/conversations/{conversation_id}", delete_conversation)
    app.router.add_post("/v1/conversations/{conversation_id}/truncate", truncate_conversation)
    branch_api.add_routes(app)
    shares_api.add_routes(app)
    app.router.add_get("/v1/usage", usage)
    feedback_api.add_routes(app)
    _add_static(app)
