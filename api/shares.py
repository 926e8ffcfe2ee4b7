"""Share links (ours, as ChatGPT's "Share"): a read-only snapshot of a conversation under an
unguessable link, owned by the conversation's organisation, revocable.

Its organisation's keys: POST /v1/conversations/{id}/shares (a snapshot, optionally up to a
message), GET /v1/shares[/{id}], POST /v1/shares/{id} (the snapshot taken again, same link) and
DELETE /v1/shares/{id} (revoke); each share names its link's full `url` (link_origin). Anyone
with the link, without a key (api/security.py lets these through): GET /v1/shared/{token}, the
snapshot's JSON as stored, and GET /share/{token}, the page (static/share.html) that renders it
with the chat UI's own Markdown sanitiser; each client address may read so many a minute and hold
a share of the bytes being sent (api/share_readers.py). A snapshot holds user and assistant
messages' text, an answer's model and attachments by name only: never a file's bytes, an image's
data: URL or an id. Snapshots count against the tier's conversation storage (api/state.py,
check_conversation_storage) and hold at most MAX_SNAPSHOT_CHARS.
"""

from __future__ import annotations

import ipaddress
import math
import re
import time
from pathlib import Path

import orjson
from aiohttp import web
from yarl import URL

from api.chat import read_json
from api.errors import ApiError, bad_request, not_found, overloaded, rate_limited
from api.export_format import attachment_names, file_ids_of
from api.paging import list_body, page_limit
from api.security import TrustedProxies, forwarded_scheme, host_name
from api.share_readers import Refusal, ShareReaders
from api.state import PRINCIPAL, SETTINGS, STATE, AppState
from store.store import Store
from store.types import Message, NotFound, Share, ShareSnapshot

SHARED_ROLES = ("user", "assistant")  # what the chat shows; system and developer instructions stay private
PAGE_PATH = "/share/{token}"
_TOKEN = re.compile(r"[A-Za-z0-9_-]{32}")  # store/shares.py's new_token: 24 bytes, URL-safe base64
_NOT_SHARED = "No shared conversation is found at this link."  # unknown, revoked or deleted alike
_UNNAMED_FILE = "file"  # an attachment whose uploaded file is gone: never its id
# The most characters a snapshot holds: every read without a key sends it whole, so a link to
# a long chat must not make each read cost what the tier's whole storage may hold.
MAX_SNAPSHOT_CHARS = 8_000_000
SENDING_RETRY_AFTER_S = 5  # a refusal for bytes in flight: about how long a reader takes a snapshot
SHARING_ENABLED_HEADER = "X-Sharing-Enabled"  # on the list of links: "true" or "false" (sharing.enabled)
# A link's answers: never kept by a cache (a revoked link must stop answering), never indexed.
PUBLIC_HEADERS = {"Cache-Control": "no-store", "X-Robots-Tag": "noindex, nofollow"}


def _host_and_port(header: str) -> tuple[str, int | None] | None:
    """A Host header's name and port, or None when it is not one host (api/security.py host_name)."""
    name, header = host_name(header), header.strip()
    if not name:
        return None
    if header.startswith("["):  # [::1]:8000; host_name checked only the port after the brackets
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
        port_text = header[header.index("]") + 1 :].removeprefix(":")
    else:  # a name or IPv4 address, with one colon before its port; an unbracketed IPv6 address has none
        port_text = header.rpartition(":")[2] if header.count(":") == 1 else ""
    port = int(port_text) if port_text else None
    return (name, port) if port is None or 0 < port < 65536 else None


def link_origin(request: web.Request) -> str:
    """Where links are given: sharing.public_base_url, else the origin the caller reached: the
    request's scheme (a trusted proxy's X-Forwarded-Proto) and its Host, which the access middleware
    accepted (a name of this server, or any with allowed_hosts "*"), rebuilt from its name and port
    so nothing else in it is echoed; a Host of another shape (only "*" lets one in): the address the
    connection came in on."""
    base = request.app[SETTINGS].sharing.public_base_url
    if base:
        return base.rstrip("/")
    host = _host_and_port(request.headers.get("Host", ""))
    if host is None:
        sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
        if isinstance(sockname, tuple) and len(sockname) >= 2:  # (address, port, ...); not a socket file
            host = (str(sockname[0]), int(sockname[1]))
        else:
            host = ("localhost", None)
    scheme = forwarded_scheme(request, request.app[READERS].proxies)
    return str(URL.build(scheme=scheme, host=host[0], port=host[1]))


def share_obj(share: Share, origin: str) -> dict:
    """The API's share object; `origin` is link_origin's."""
    page = PAGE_PATH.format(token=share.token)
    return {
        "id": share.id,
        "object": "conversation.share",
        "conversation_id": share.conversation_id,
        "token": share.token,
        "url": origin + page,  # the link to give: the page, whose JSON is /v1/shared/{token}
        "path": page,
        "title": share.title,
        "num_messages": share.num_messages,
        "last_message_id": share.last_message_id,
        "snapshot_chars": share.num_chars,  # counted against the conversation storage cap
        "created_at": int(share.created_at),
        "snapshot_at": int(share.snapshot_at),
    }


def shared_message(m: Message, file_names: dict[str, str]) -> dict:
    """One message as a link shows it: text, an answer's model (and how it ended, if not plainly),
    attachments by name (`file_names`: every file id the parts name, to its filename or a stand-in)."""
    obj: dict = {"role": m.role, "content": m.content}
    if m.role == "assistant":
        obj["model"] = m.model
        if m.finish_reason not in (None, "stop"):
            obj["finish_reason"] = m.finish_reason
    names = attachment_names(orjson.loads(m.parts_json), file_names) if m.parts_json else []
    if names:
        obj["attachments"] = names
    return obj


def snapshot_of(title: str | None, kept: tuple[Message, ...], file_names: dict[str, str]) -> ShareSnapshot:
    """The snapshot of `kept` (the conversation's first messages), taken now."""
    taken_at = time.time()
    body = {
        "object": "conversation.shared",
        "title": title,
        "created_at": int(taken_at),  # when the snapshot was taken
        "messages": [shared_message(m, file_names) for m in kept if m.role in SHARED_ROLES],
    }
    return ShareSnapshot(title, len(kept), kept[-1].id, orjson.dumps(body).decode(), taken_at)


async def take_snapshot(store: Store, org_id: str, conversation_id: str, message_id: str | None) -> ShareSnapshot:
    """The organisation's conversation up to and including `message_id` (None: all of it)."""
    conv = await store.get_conversation(org_id, conversation_id)
    if conv is None:
        raise not_found(f"No conversation found with id '{conversation_id}'.", param="conversation_id")
    kept = conv.messages
    if message_id is not None:
        ids = [m.id for m in kept]
        if message_id not in ids:
            raise bad_request(f"'{message_id}' is no message of conversation '{conversation_id}'.", param="message_id")
        kept = kept[: ids.index(message_id) + 1]
    if not any(m.role in SHARED_ROLES for m in kept):
        raise bad_request("The conversation has no messages to share yet.", param="conversation_id")
    file_ids = sorted({i for m in kept if m.parts_json for i in file_ids_of(orjson.loads(m.parts_json))})
    stored = await store.get_files(org_id, file_ids) if file_ids else {}
    file_names = {i: stored[i].filename if i in stored else _UNNAMED_FILE for i in file_ids}
    snapshot = snapshot_of(conv.title, kept, file_names)
    if len(snapshot.snapshot_json) > MAX_SNAPSHOT_CHARS:
        raise bad_request(
            f"A share link shows at most {MAX_SNAPSHOT_CHARS:,} characters; this snapshot would hold "
            f"{len(snapshot.snapshot_json):,}. Share the conversation up to an earlier message ('message_id').",
            param="message_id",
            code="snapshot_too_large",
        )
    return snapshot


def _check_enabled(request: web.Request) -> None:
    if not request.app[SETTINGS].sharing.enabled:
        raise ApiError(
            403,
            "Sharing conversations is turned off on this server (sharing.enabled).",
            "permission_error",
            "sharing_disabled",
        )


async def _message_id(request: web.Request) -> str | None:
    """The optional body's `message_id`: the last message the snapshot holds."""
    body = await read_json(request) if request.body_exists else {}
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    for key in body:
        if key != "message_id":
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    message_id = body.get("message_id")
    if message_id is not None and not isinstance(message_id, str):
        raise bad_request("'message_id' must name the last message the link shows.", param="message_id")
    return message_id


def _share_missing(share_id: str) -> ApiError:
    return not_found(f"No share found with id '{share_id}'.", param="share_id")


async def create_share(request: web.Request) -> web.Response:
    """{"message_id": optional}: a new link to a snapshot of the conversation (up to that message)."""
    _check_enabled(request)
    cid = request.match_info["conversation_id"]
    message_id = await _message_id(request)
    state, principal = request.app[STATE], request[PRINCIPAL]
    snapshot = await take_snapshot(state.store, principal.org.id, cid, message_id)
    await state.check_conversation_storage(principal, len(snapshot.snapshot_json))
    share = await state.store.create_share(principal.org.id, cid, snapshot)
    if share is None:  # deleted since it was read
        state.forget_conversation_bytes(principal.org.id)
        raise not_found(f"No conversation found with id '{cid}'.", param="conversation_id")
    return web.json_response(share_obj(share, link_origin(request)), status=201)


async def update_share(request: web.Request) -> web.Response:
    """{"message_id": optional}: the snapshot taken again from the conversation as it is now (up to
    that message); the link stays the same."""
    _check_enabled(request)
    sid = request.match_info["share_id"]
    message_id = await _message_id(request)
    state, principal = request.app[STATE], request[PRINCIPAL]
    share = await state.store.get_share(principal.org.id, sid)
    if share is None:
        raise _share_missing(sid)
    snapshot = await take_snapshot(state.store, principal.org.id, share.conversation_id, message_id)
    await state.check_conversation_storage(principal, max(0, len(snapshot.snapshot_json) - share.num_chars))
    updated = await state.store.replace_share_snapshot(principal.org.id, sid, snapshot)
    state.forget_conversation_bytes(principal.org.id)  # it may have shrunk, or not been written
    if updated is None:  # revoked, or its conversation deleted, meanwhile
        raise _share_missing(sid)
    return web.json_response(share_obj(updated, link_origin(request)))


async def list_shares(request: web.Request) -> web.Response:
    """The organisation's links, newest first, a page at a time; `conversation_id` narrows them to one
    conversation's. X-Sharing-Enabled says whether new ones may be made (sharing.enabled)."""
    limit = page_limit(request.query, default=20, maximum=100)
    after, cid = request.query.get("after"), request.query.get("conversation_id")
    store, org_id = request.app[STATE].store, request[PRINCIPAL].org.id
    try:
        shares, has_more = await store.list_shares(org_id, conversation_id=cid, limit=limit, after=after)
    except NotFound:
        raise not_found(f"No share found with id '{after}' (the 'after' cursor).", param="after") from None
    origin = link_origin(request)
    data = [share_obj(s, origin) for s in shares]
    body = list_body(data, has_more)
    # The web chat offers its Share button only where creating a link can succeed.
    enabled = "true" if request.app[SETTINGS].sharing.enabled else "false"
    return web.json_response(body, headers={SHARING_ENABLED_HEADER: enabled})


async def get_share(request: web.Request) -> web.Response:
    sid = request.match_info["share_id"]
    share = await request.app[STATE].store.get_share(request[PRINCIPAL].org.id, sid)
    if share is None:
        raise _share_missing(sid)
    return web.json_response(share_obj(share, link_origin(request)))


async def revoke_share(request: web.Request) -> web.Response:
    """The link answers 404 from now on; its snapshot is deleted."""
    sid = request.match_info["share_id"]
    state, org_id = request.app[STATE], request[PRINCIPAL].org.id
    if not await state.store.delete_share(org_id, sid):
        raise _share_missing(sid)
    state.forget_conversation_bytes(org_id)  # room again under its cap
    return web.json_response({"id": sid, "object": "conversation.share.deleted", "deleted": True})


READERS = web.AppKey("share_readers", ShareReaders)


async def _shared_snapshot(state: AppState, token: str) -> str | None:
    """The snapshot a link's token names; None for a token of another shape (no read), an unknown
    or revoked one, a deleted conversation's, or any while sharing is off."""
    if not state.settings.sharing.enabled or not _TOKEN.fullmatch(token):
        return None
    return await state.store.shared_snapshot(token)


def _retry_after(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))


def _too_many_reads(request: web.Request, wait_s: float) -> ApiError:
    reads = request.app[SETTINGS].sharing.reads_per_minute
    return rate_limited(
        f"Too many reads of shared conversations from this address (limit {reads} a minute, "
        f"sharing.reads_per_minute); try again in {_retry_after(wait_s)} s.",
        retry_after_s=wait_s,
    )


def _sending_refused(refusal: Refusal) -> ApiError:
    if refusal is Refusal.CLIENT_SENDING:
        return rate_limited(
            "Shared conversations still being sent to this address hold its share of the server; try again once "
            "they have arrived.",
            retry_after_s=SENDING_RETRY_AFTER_S,
        )
    return overloaded(
        "Shared conversations are being sent to many readers at once; try again shortly.",
        retry_after_s=SENDING_RETRY_AFTER_S,
    )


async def read_shared(request: web.Request) -> web.Response:
    """GET /v1/shared/{token}, no key: the snapshot's JSON as it was stored (nothing rendered per read);
    429 past the address's reads a minute, or while its snapshots being sent hold its share of the
    bound; 503 while all of them hold the bound (api/share_readers.py)."""
    readers = request.app[READERS]
    client = readers.client_of(request.remote)
    wait_s = readers.take_read(client)
    if wait_s > 0:
        raise _too_many_reads(request, wait_s)
    snapshot = await _shared_snapshot(request.app[STATE], request.match_info["token"])
    if snapshot is None:
        raise not_found(_NOT_SHARED, code="share_not_found")
    body = snapshot.encode()
    refusal = readers.start_sending(client, len(body))
    if refusal is not None:
        raise _sending_refused(refusal)
    response = web.Response(body=body, content_type="application/json", charset="utf-8", headers=PUBLIC_HEADERS)
    try:  # sent here, not after the handler returns: the bytes count until the connection took them
        await response.prepare(request)
        await response.write_eof()
    finally:
        readers.stop_sending(client, len(body))
    return response


def _add_page(app: web.Application) -> None:
    """GET /share/{token}: static/share.html, which reads the JSON above and renders it; 404 (the
    same page, which then says the link shows nothing) where the JSON is 404, and 429 with
    Retry-After (the same page, which then says when to try again) past the address's reads."""
    page = Path(app[SETTINGS].server.static_dir) / "share.html"

    async def shared_page(request: web.Request) -> web.StreamResponse:
        if not page.exists():
            return web.Response(text="The web UI is not installed (static/share.html missing).", status=404)
        readers = request.app[READERS]
        wait_s = readers.take_read(readers.client_of(request.remote))
        if wait_s > 0:  # its JSON read will be refused too, and the page says so
            return web.FileResponse(page, status=429, headers={**PUBLIC_HEADERS, "Retry-After": _retry_after(wait_s)})
        found = await _shared_snapshot(request.app[STATE], request.match_info["token"])
        return web.FileResponse(page, status=200 if found is not None else 404, headers=PUBLIC_HEADERS)

    app.router.add_get(PAGE_PATH, shared_page)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/conversations/{conversation_id}/shares", create_share)
    app.router.add_get("/v1/shares", list_shares)
    app.router.add_get("/v1/shares/{share_id}", get_share)
    app.router.add_post("/v1/shares/{share_id}", update_share)
    app.router.add_delete("/v1/shares/{share_id}", revoke_share)
    settings = app[SETTINGS]
    app[READERS] = ShareReaders(settings.sharing.reads_per_minute, TrustedProxies.from_settings(settings))
    app.router.add_get("/v1/shared/{token}", read_shared)
    _add_page(app)
