"""Taking conversations out (our extension): GET /v1/conversations/{id}/export as Markdown or JSON,
and GET /v1/conversations/export, every live conversation of the caller's organisation as one
JSON document, streamed a conversation at a time so that a long history never sits in memory.

Reads only, through the same store reads as GET /v1/conversations/{id}; the document's text is
made in api/export_format.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import orjson
import structlog
from aiohttp import web

from api.conversation_objects import read_conversation
from api.errors import bad_request, not_found
from api.export_format import attachment_names, content_disposition, file_ids_of, markdown_document
from api.state import PRINCIPAL, STATE
from store.store import Store

log = structlog.get_logger(__name__)

FORMATS = ("markdown", "json")
PAGE_SIZE = 50  # conversations listed per store read while exporting them all
_EXPORT_ALL_FILENAME = "conversations"


def _format(query: Mapping[str, str], allowed: tuple[str, ...], default: str) -> str:
    value = query.get("format", default)
    if value not in allowed:
        raise bad_request(f"'format' must be {' or '.join(allowed)}, got {value!r}.", param="format")
    return value


async def _document(store: Store, org_id: str, conversation_id: str) -> dict | None:
    """The conversation as GET renders it, each message with attachments also naming them
    (`attachments`: names of its files and images, one read for the uploaded files' names)."""
    obj = await read_conversation(store, org_id, conversation_id)
    if obj is None:
        return None
    file_ids = sorted({i for m in obj["messages"] for i in file_ids_of(m.get("parts") or [])})
    stored = await store.get_files(org_id, file_ids) if file_ids else {}
    file_names = {file_id: f.filename for file_id, f in stored.items()}
    for message in obj["messages"]:
        names = attachment_names(message.get("parts") or [], file_names)
        if names:
            message["attachments"] = names
    return obj


async def export_conversation(request: web.Request) -> web.Response:
    """`format=markdown` (the default) or `json`, as a download named after the title."""
    fmt = _format(request.query, FORMATS, "markdown")
    cid = request.match_info["conversation_id"]
    obj = await _document(request.app[STATE].store, request[PRINCIPAL].org.id, cid)
    if obj is None:
        raise not_found(f"No conversation found with id '{cid}'.", param="conversation_id")
    if fmt == "json":
        body, content_type, extension = orjson.dumps(obj), "application/json", "json"
    else:
        body, content_type, extension = markdown_document(obj).encode(), "text/markdown; charset=utf-8", "md"
    headers = {
        "Content-Type": content_type,
        "Content-Disposition": content_disposition(obj["title"], cid, extension),
        "Cache-Control": "no-store",
    }
    return web.Response(body=body, headers=headers)


async def _all_documents(store: Store, org_id: str) -> AsyncIterator[dict]:
    """Every live conversation, newest created first, read a page of PAGE_SIZE at a time; one
    deleted between its page and its read is left out."""
    before: tuple[float, str] | None = None
    while True:
        page = await store.list_conversations_created(org_id, limit=PAGE_SIZE, before=before)
        for conv in page:
            obj = await _document(store, org_id, conv.id)
            if obj is not None:
                yield obj
        if len(page) < PAGE_SIZE:
            return
        before = (page[-1].created_at, page[-1].id)


async def export_all(request: web.Request) -> web.StreamResponse:
    """`{"object": "list", "data": [conversation, ...]}` with every conversation as its own export
    gives it in JSON. One request against the caller's request limit, however many it holds."""
    _format(request.query, ("json",), "json")
    state, principal = request.app[STATE], request[PRINCIPAL]
    state.charge_request(principal)  # before anything is read or sent; 429 as any limited call
    response = web.StreamResponse(
        headers={
            "Content-Type": "application/json",
            "Content-Disposition": content_disposition(_EXPORT_ALL_FILENAME, _EXPORT_ALL_FILENAME, "json"),
            "Cache-Control": "no-store",
        }
    )
    await response.prepare(request)
    await response.write(b'{"object":"list","data":[')
    separator = b""
    try:
        async for obj in _all_documents(state.store, principal.org.id):
            await response.write(separator + orjson.dumps(obj))
            separator = b","
    except OSError:
        raise  # the client went away: nothing to tell it
    except Exception:
        # Headers are sent: no error shape fits now. Cut the connection so that the client sees an
        # unfinished download, never a complete-looking document that misses conversations.
        log.exception("export_failed", org_id=principal.org.id)
        if request.transport is not None:
            request.transport.abort()
        return response
    await response.write(b"]}")
    await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    """Before /v1/conversations/{conversation_id}, which `export` would otherwise match."""
    app.router.add_get("/v1/conversations/export", export_all)
    app.router.add_get("/v1/conversations/{conversation_id}/export", export_conversation)
