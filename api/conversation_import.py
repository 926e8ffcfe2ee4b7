"""POST /v1/conversations/import (our extension): what the JSON exports write (api/export.py) back
in, as new conversations of the caller's organisation under new ids, all in one transaction or none.

The body is read as every JSON body is (server.max_body_bytes, the body deadline), checked whole
(api/import_document.py, a big one on a worker thread), its inline files and data: URL images read
as a turn reads them, and against the tier's conversation storage before the one write. Nothing is
billed; the access middleware counts it as one request.
"""

from __future__ import annotations

import time

import structlog
from aiohttp import web

from api import import_document
from api.attachment_parts import AttachContext, resolve
from api.chat import parse_body, read_json
from api.conversation_objects import conversation_obj
from api.files import BLOBS, TEXTS
from api.import_document import ImportDocument, ImportLimits, parse_document
from api.protocol import ChatMessage
from api.state import PRINCIPAL, STATE

log = structlog.get_logger(__name__)

PATH = "/v1/conversations/import"


async def import_conversations(request: web.Request) -> web.Response:
    """201 with `{"object": "conversation.import", "num_conversations", "num_messages", "data":
    [conversation, ...], "unavailable_file_ids": [...]}`: each new conversation (as listed) with
    `imported_from`, its id in the file, in the file's order; the uploaded files the messages name
    that this organisation does not have (their parts stay, shown as no longer available)."""
    state, org_id = request.app[STATE], request[PRINCIPAL].org.id
    raw = await read_json(request)
    limits = ImportLimits(
        state.settings.server.max_prompt_chars,
        import_document.MAX_IMPORT_CONVERSATIONS,
        import_document.MAX_IMPORT_MESSAGES,
    )
    num_bytes = len(await request.read())  # read already: cached on the request
    document: ImportDocument = await parse_body(parse_document, raw, limits, time.time(), num_bytes=num_bytes)
    await _read_attachments(request, document)
    await state.check_conversation_storage(request[PRINCIPAL], document.num_chars)  # the cap's own 400
    try:
        created = await state.store.import_conversations(org_id, list(document.conversations))
    except BaseException:
        state.forget_conversation_bytes(org_id)  # counted above, never stored
        raise
    found = await state.store.get_files(org_id, list(document.file_ids)) if document.file_ids else {}
    log.info(
        "conversations_imported",
        org_id=org_id,
        num_conversations=len(created),
        num_messages=document.num_messages,
        num_chars=document.num_chars,
    )
    data = [
        {**conversation_obj(conv, with_messages=False), "imported_from": source_id}
        for conv, source_id in zip(created, document.source_ids, strict=True)
    ]
    body = {
        "object": "conversation.import",
        "num_conversations": len(created),
        "num_messages": document.num_messages,
        "data": data,
        "unavailable_file_ids": [file_id for file_id in document.file_ids if file_id not in found],
    }
    return web.json_response(body, status=201)


async def _read_attachments(request: web.Request, document: ImportDocument) -> None:
    """Each inline file read and each data: URL image checked from its header, as a turn sending
    them reads them (a 400 naming the field): every later turn reads its conversation's again, and
    one that cannot be read made each of them a 400. The files' text is then in memory for them."""
    if not document.attachments:
        return
    state = request.app[STATE]
    files, images = state.settings.files, state.settings.images
    ctx = AttachContext(state.store, request.app[BLOBS], request[PRINCIPAL].org.id, files, images, request.app[TEXTS])
    await resolve(ctx, ChatMessage("user", "", document.attachments), with_images=True, decode=False)


def add_routes(app: web.Application) -> None:
    """Before POST /v1/conversations/{conversation_id} (OpenAI's update), which would take `import`
    as a conversation's id."""
    app.router.add_post(PATH, import_conversations)
