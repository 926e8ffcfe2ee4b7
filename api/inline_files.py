"""Files sent inside a request (chat's `file_data`, the Responses API's `input_file.file_data`,
an Anthropic `document` block) decoded, checked and read as an uploaded file is read.

Owns their refusals (not base64, larger than files.max_file_bytes, an image) with the field the
client spelled. The type is sniffed as an upload's is (api/files.sniff_media_type), and the text
is read by the same readers under the same limits (media/extraction.py: a PDF in a child process
with its deadline and memory cap). The bytes are never kept: they sit in a scratch file beside the
uploads only while they are read. The text is kept in memory by the bytes' hash (TextMemory), so
the next turn of a stored conversation, whose message holds the data: URL, renders it again
without reading it. It does not render prompts (api/attachment_parts.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

from api.errors import bad_request
from api.files import printable_name, sniff_media_type
from api.parts import InlineFilePart
from media import extraction
from media.documents import DocumentText, ExtractLimits
from media.workers import run_blocking
from store.blobs import Blobs

DEFAULT_FILENAME = "document"


@dataclass(frozen=True, slots=True)
class InlineFile:
    key: str  # inline-<media type>-<sha256 of the bytes>: its text's key in memory (TextMemory, Seen)
    filename: str
    media_type: str
    data: bytes


def decode(part: InlineFilePart, max_file_bytes: int) -> InlineFile:
    """The part's bytes and sniffed type (blocking: base64 and the hash of up to max_file_bytes)."""
    payload = part.payload
    if len(payload) * 3 // 4 - 2 > max_file_bytes:  # refused before decoding a byte
        raise _too_large(part, len(payload) * 3 // 4, max_file_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(
            f"'{part.param}' holds invalid base64 after 'base64,' (standard alphabet, padded, no line breaks).",
            param=part.param,
            code="invalid_file_data",
        ) from None
    if len(data) > max_file_bytes:
        raise _too_large(part, len(data), max_file_bytes)
    filename = printable_name(part.filename) or DEFAULT_FILENAME
    media_type = sniff_media_type(data[:16], part.media_type, filename)
    if media_type.startswith("image/"):
        raise bad_request(
            f"'{part.param}' holds an image ({media_type}); send images as images (an image_url or input_image"
            " part, an Anthropic image block): file parts are read as documents (text or PDF).",
            param=part.param,
            code="unsupported_file_type",
        )
    key = f"inline-{media_type}-{hashlib.sha256(data).hexdigest()}"
    return InlineFile(key, filename, media_type, data)


def _too_large(part: InlineFilePart, num_bytes: int, max_file_bytes: int):
    return bad_request(
        f"The file in '{part.param}' holds about {num_bytes} bytes; the limit is {max_file_bytes}"
        " (files.max_file_bytes, as for an upload).",
        param=part.param,
        code="file_too_large",
    )


async def read(file: InlineFile, blobs: Blobs, limits: ExtractLimits, max_concurrent: int) -> DocumentText:
    """The file's text, read as an upload's (raises UnreadableDocument or ExtractionBusy); its
    scratch file and that file's text cache are removed however the reading ends."""
    path = blobs.scratch_path()
    cache_path = path.with_suffix(".txt")
    try:
        await run_blocking(path.write_bytes, file.data)
        return await extraction.cached_extract(path, cache_path, file.media_type, limits, max_concurrent)
    finally:  # not awaited: a cancelled request removes them too
        path.unlink(missing_ok=True)
        cache_path.unlink(missing_ok=True)
