"""The Files API in OpenAI's shapes: upload (multipart, streamed to disk), list, get, content, delete.

Owns the upload path's limits: the file size and the organisation's quota are checked while
the body streams (the upload is cut off as soon as it passes either), and the tier's
retention sets `expires_at`. Bytes live in `Blobs` (on disk, by id), metadata in the store,
recently used extracted texts in `TextMemory` (forgotten when the file goes).
Another organisation's file, or an expired one, is a 404.
"""

from __future__ import annotations

import asyncio
import mimetypes
import time
import unicodedata
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import structlog
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from api.connections import CLOSE_AFTER, malformed_body
from api.errors import ApiError, bad_request, not_found
from api.paging import list_body, page_limit, page_order
from api.state import PRINCIPAL, SETTINGS, STATE
from media.text_memory import TextMemory
from settings import ConfigError, Settings
from store.blobs import Blobs, Upload, is_file_id, new_file_id
from store.types import FileQuery, FileQuota, QuotaExceeded, StoredFile, StoreError

log = structlog.get_logger(__name__)

BLOBS = web.AppKey("blobs", Blobs)
TEXTS = web.AppKey("texts", TextMemory)
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
CHUNK_BYTES = 65_536
_MULTIPART_OVERHEAD_BYTES = 16_384  # boundaries, part headers and the purpose field
_MAX_FILENAME_CHARS = 255
# Served inline (thumbnails, previews); everything else downloads as octet-stream.
INLINE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp", "text/plain")
_MAGIC = (
    (b"%PDF-", "application/pdf"),
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def files_root(settings: Settings) -> Path:
    return Path(settings.files.dir) if settings.files.dir else Path(settings.store.path).parent / "files"


def file_obj(f: StoredFile) -> dict:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": int(f.created_at),
        "expires_at": None if f.expires_at is None else int(f.expires_at),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
    }


def sniff_media_type(head: bytes, declared: str | None, filename: str) -> str:
    """Magic bytes first (a PNG named .txt is a PNG), then the part's type, then the name."""
    for magic, media_type in _MAGIC:
        if head.startswith(magic):
            return media_type
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if declared and declared != "application/octet-stream":
        return declared.split(";")[0].strip().lower()
    return mimetypes.guess_type(filename)[0] or "application/octet-stream"


def printable_name(raw: str | None) -> str:
    """The name without folders or control characters, at most 255 characters ('' if none is left)."""
    name = (raw or "").replace("\\", "/").rsplit("/", 1)[-1]
    return "".join(ch for ch in name if unicodedata.category(ch)[0] != "C").strip()[:_MAX_FILENAME_CHARS]


def clean_filename(raw: str | None) -> str:
    name = printable_name(raw)
    if not name:
        raise bad_request("The file part must have a filename.", param="file")
    return name


def _quota_error(message: str) -> ApiError:
    return ApiError(400, f"File quota exceeded: {message}.", "invalid_request_error", "file_quota_exceeded", "file")


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The file is larger than the {limit} bytes allowed for one upload.",
        "invalid_request_error",
        "file_too_large",
        "file",
    )


# -- upload -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class UploadLimits:
    quota: FileQuota
    max_file_bytes: int  # the server's limit for one upload
    room_bytes: int  # what the organisation's storage quota has left
    idle_s: float  # server.body_timeout_s: an upload that sends nothing for this long ends with 408

    @property
    def max_bytes(self) -> int:
        return min(self.max_file_bytes, self.room_bytes)

    def refusal(self) -> ApiError:
        if self.room_bytes >= self.max_file_bytes:
            return _too_large(self.max_file_bytes)
        return _quota_error(
            f"this upload passes the {self.room_bytes} bytes left of the organisation's"
            f" {self.quota.max_bytes} bytes of file storage"
        )


async def _upload_limits(request: web.Request) -> UploadLimits:
    """The tier's quota and the most bytes this upload may have (file limit or quota room)."""
    state, settings = request.app[STATE], request.app[SETTINGS]
    principal = request[PRINCIPAL]
    _, tier = state.tier_of(principal)
    quota = FileQuota(max_files=tier.max_files, max_bytes=tier.file_storage_bytes)
    num_files, num_bytes = await state.store.file_usage(principal.org.id)
    if num_files >= quota.max_files:
        raise _quota_error(f"the organisation keeps {num_files} files; its tier allows {quota.max_files}")
    max_bytes = settings.files.max_file_bytes
    declared = request.content_length
    if declared is not None and declared > max_bytes + _MULTIPART_OVERHEAD_BYTES:
        raise _too_large(max_bytes)  # refused before a byte of the body is read
    return UploadLimits(quota, max_bytes, quota.max_bytes - num_bytes, settings.server.body_timeout_s)


async def _stream_part(part: BodyPartReader, upload: Upload, limits: UploadLimits) -> bytes:
    """Copy the part to disk chunk by chunk; returns its first bytes (for sniffing)."""
    head = b""
    while chunk := await _arrives(part.read_chunk(CHUNK_BYTES), limits.idle_s):
        if upload.num_bytes + len(chunk) > limits.max_bytes:
            raise limits.refusal()  # the rest of the body is never read
        if len(head) < 16:
            head += chunk[: 16 - len(head)]
        upload.write(chunk)
    return head


async def _arrives(read, idle_s: float):
    """One read of an upload, which must bring bytes within `idle_s` (else TimeoutError)."""
    async with asyncio.timeout(idle_s):
        return await read


async def _read_small_field(part: BodyPartReader, name: str, idle_s: float, max_bytes: int = 256) -> str:
    data = b""
    while chunk := await _arrives(part.read_chunk(max_bytes), idle_s):
        data += chunk
        if len(data) > max_bytes:
            raise bad_request(f"'{name}' is longer than {max_bytes} bytes.", param=name)
    return data.decode("utf-8", errors="replace").strip()


async def create_file(request: web.Request) -> web.Response:
    if not request.content_type.startswith("multipart/"):
        raise bad_request(
            f"Content-Type must be multipart/form-data, got {request.content_type}.", code="invalid_content_type"
        )
    limits = await _upload_limits(request)
    upload = request.app[BLOBS].start_upload()
    try:
        try:
            purpose, filename, media_type = await _read_form(request, upload, limits)
        except TimeoutError:  # a stalled upload: the body deadline, as for every other body
            request[CLOSE_AFTER] = True
            log.warning("body_timeout", peer=request.remote, timeout_s=limits.idle_s, upload=True)
            raise ApiError(
                408, f"The upload sent nothing for {limits.idle_s:g} s.", "invalid_request_error", "request_timeout"
            ) from None
        except RequestPayloadError as exc:  # bytes that its Content-Encoding does not decode
            raise malformed_body(request, exc) from None
        except (ValueError, HttpProcessingError) as exc:  # aiohttp's parser: no boundary, a broken delimiter or header
            raise bad_request(f"The multipart body cannot be read: {exc}.", code="invalid_multipart") from None
        stored = await _commit(request, upload, limits.quota, (purpose, filename, media_type))
    except BaseException:
        upload.discard()  # no-op after a commit that moved the file into place
        raise
    log.info("file_uploaded", file_id=stored.id, bytes=stored.bytes, purpose=stored.purpose)
    return web.json_response(file_obj(stored))


async def _read_form(request: web.Request, upload: Upload, limits: UploadLimits) -> tuple[str, str, str]:
    purpose = filename = media_type = None
    reader = await request.multipart()
    while (part := await _arrives(reader.next(), limits.idle_s)) is not None:
        if not isinstance(part, BodyPartReader):
            raise bad_request("Nested multipart bodies are not supported.", param="file")
        if part.name == "purpose":
            purpose = await _read_small_field(part, "purpose", limits.idle_s)
        elif part.name == "file" and filename is None:
            filename = clean_filename(part.filename)
            head = await _stream_part(part, upload, limits)
            media_type = sniff_media_type(head, part.headers.get("Content-Type"), filename)
        else:
            raise bad_request(f"Unexpected form field {part.name!r}; send 'file' and 'purpose'.", param=part.name)
    if filename is None or media_type is None:  # both come with the file part
        raise bad_request("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    if purpose not in PURPOSES:
        raise bad_request(f"'purpose' must be one of {', '.join(PURPOSES)}; got {purpose!r}.", param="purpose")
    return purpose, filename, media_type


async def _commit(request: web.Request, upload: Upload, quota: FileQuota, meta: tuple[str, str, str]) -> StoredFile:
    """Bytes into place first, then the row (quota re-checked in its transaction); undo on refusal."""
    state, principal = request.app[STATE], request[PRINCIPAL]
    _, tier = state.tier_of(principal)
    now = time.time()
    purpose, filename, media_type = meta
    stored = StoredFile(
        id=new_file_id(),
        org_id=principal.org.id,
        filename=filename,
        purpose=purpose,
        bytes=upload.num_bytes,
        sha256=upload.sha256,
        media_type=media_type,
        created_at=now,
        expires_at=now + tier.file_retention_days * 86400.0 if tier.file_retention_days > 0 else None,
    )
    blobs = request.app[BLOBS]
    await asyncio.to_thread(upload.commit, stored.id)
    try:
        return await state.store.insert_file(stored, quota)
    except QuotaExceeded as exc:
        blobs.remove(stored.id)
        raise _quota_error(str(exc)) from None
    except BaseException:
        blobs.remove(stored.id)
        raise


# -- reads and delete ---------------------------------------------------------------------
async def owned_file(request: web.Request, file_id: str) -> StoredFile:
    """The caller's live file `file_id`, or a 404 (never saying whether another org has it)."""
    found = None
    if is_file_id(file_id):
        found = await request.app[STATE].store.get_file(request[PRINCIPAL].org.id, file_id)
    if found is None:
        raise not_found(f"No such File object: {file_id}", param="file_id")
    return found


def _list_query(request: web.Request) -> FileQuery:
    q = request.query
    limit, order = page_limit(q, default=10_000, maximum=10_000), page_order(q)
    purpose = q.get("purpose") or None
    if purpose is not None and purpose not in PURPOSES:
        raise bad_request(f"'purpose' must be one of {', '.join(PURPOSES)}; got {purpose!r}.", param="purpose")
    return FileQuery(limit=limit, purpose=purpose, after=q.get("after") or None, ascending=order == "asc")


async def list_files(request: web.Request) -> web.Response:
    found, has_more = await request.app[STATE].store.list_files(request[PRINCIPAL].org.id, _list_query(request))
    data = [file_obj(f) for f in found]
    body = list_body(data, has_more)
    # The web UI refuses a too-large file before uploading it.
    return web.json_response(body, headers={"X-Max-File-Bytes": str(request.app[SETTINGS].files.max_file_bytes)})


async def get_file(request: web.Request) -> web.Response:
    return web.json_response(file_obj(await owned_file(request, request.match_info["file_id"])))


async def file_content(request: web.Request) -> web.StreamResponse:
    stored = await owned_file(request, request.match_info["file_id"])
    path = request.app[BLOBS].path(stored.id)
    if not path.exists():
        raise not_found(f"The content of {stored.id} is missing on disk.", param="file_id")
    inline = stored.media_type in INLINE_TYPES
    headers = {
        "Content-Type": stored.media_type if inline else "application/octet-stream",
        # User content on our origin: never run as a page, whatever it holds.
        "Content-Security-Policy": "sandbox; default-src 'none'; img-src 'self'",
        "Content-Disposition": "inline"
        if inline
        else f"attachment; filename*=UTF-8''{quote(stored.filename, safe='')}",
        "Cache-Control": "private, max-age=3600",
    }
    return web.FileResponse(path, headers=headers)


async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    stored = await owned_file(request, file_id)
    if not await request.app[STATE].store.delete_file(stored.org_id, stored.id):
        raise not_found(f"No such File object: {file_id}", param="file_id")
    request.app[BLOBS].remove(stored.id)
    request.app[TEXTS].forget(stored.id)
    return web.json_response({"id": stored.id, "object": "file", "deleted": True})


# -- lifecycle ----------------------------------------------------------------------------
async def purge_once(store, blobs: Blobs, now: float | None = None, texts: TextMemory | None = None) -> int:
    """Remove expired files (rows, then bytes, then texts in memory) and orphaned bytes; returns how
    many files went."""
    expired = await store.purge_expired_files(now)
    for file_id in expired:
        blobs.remove(file_id)
        if texts is not None:
            texts.forget(file_id)
    blobs.sweep_orphans(await store.file_ids())
    if expired:
        log.info("expired_files_purged", num_files=len(expired))
    return len(expired)


async def _files_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    root = files_root(settings)
    try:
        app[BLOBS] = blobs = Blobs(root)
    except OSError as exc:  # a missing parent, a read-only disk: at start, not at the first upload
        where = "files.dir" if settings.files.dir else "files.dir (empty: beside the database)"
        raise ConfigError(f"{where}: cannot keep uploaded files in {root}: {exc.strerror or exc}") from None
    store = app[STATE].store
    app[TEXTS] = texts = TextMemory(settings.files.max_text_memory_chars)

    async def loop() -> None:
        while True:
            try:
                await purge_once(store, blobs, texts=texts)
            except (StoreError, OSError) as exc:
                log.warning("file_purge_failed", error=str(exc))
            await asyncio.sleep(settings.store.purge_interval_s)

    task = asyncio.create_task(loop(), name="files-purge")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def setup(app: web.Application) -> None:
    """Routes and lifecycle of the Files API; call after the app's main lifecycle is registered."""
    app.cleanup_ctx.append(_files_ctx)
    app.router.add_post("/v1/files", create_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
