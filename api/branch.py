"""POST /v1/conversations/{id}/branch (ours, as ChatGPT's "Branch in new chat"): a new conversation
holding a copy of this one's messages up to and including one of them, to take another way from
there while the original stays as it is. One store transaction copies them (store.conversations.branch)."""

from __future__ import annotations

from aiohttp import web

from api.chat import read_json
from api.conversation_objects import read_conversation
from api.errors import bad_request, not_found
from api.fields import MAX_TITLE_CHARS
from api.state import PRINCIPAL, STATE

FIELDS = ("message_id", "title")
BRANCH_TITLE = "Branch \u00b7 {title}"  # the default title: the source's, marked


async def branch_conversation(request: web.Request) -> web.Response:
    """{"message_id": id, "title": optional}: the copy holds the messages up to and including
    `message_id` (new ids; an answer keeps its model and ledger row), the source's metadata, and
    `title` (default "Branch · <the source's title>"). Its text counts against the tier's
    conversation storage like any turn. Answers the new conversation, as GET renders it."""
    cid = request.match_info["conversation_id"]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object with 'message_id'.", param=None)
    for key in body:
        if key not in FIELDS:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    message_id, title = body.get("message_id"), body.get("title")
    if not isinstance(message_id, str):
        raise bad_request("'message_id' must name the message the branch ends with.", param="message_id")
    if title is not None and (not isinstance(title, str) or not title.strip() or len(title) > MAX_TITLE_CHARS):
        raise bad_request(f"'title' must be a non-empty string of at most {MAX_TITLE_CHARS} characters.", param="title")
    state, principal = request.app[STATE], request[PRINCIPAL]
    org_id = principal.org.id
    source = await state.store.get_conversation(org_id, cid)
    if source is None:
        raise not_found(f"No conversation found with id '{cid}'.", param="conversation_id")
    ids = [m.id for m in source.messages]
    if message_id not in ids:
        raise bad_request(f"'{message_id}' is no message of conversation '{cid}'.", param="message_id")
    kept = source.messages[: ids.index(message_id) + 1]
    await state.check_conversation_storage(principal, sum(len(m.content) + len(m.parts_json or "") for m in kept))
    default = BRANCH_TITLE.format(title=source.title or "Untitled")[:MAX_TITLE_CHARS]
    made = None
    try:
        made = await state.store.branch_conversation(
            org_id, cid, len(kept), title=title.strip() if title else default, last_message_id=message_id
        )
    finally:
        if made is None:  # counted above, never stored: the next check reads the store
            state.forget_conversation_bytes(org_id)
    if made is None:  # deleted, or cut and written again, before the copy was made
        raise not_found(f"Conversation '{cid}' changed while it was branched; read it again.", param="conversation_id")
    obj = await read_conversation(state.store, org_id, made.id)
    if obj is None:  # deleted at once by another client
        raise not_found(f"No conversation found with id '{made.id}'.", param="conversation_id")
    return web.json_response(obj)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/conversations/{conversation_id}/branch", branch_conversation)
