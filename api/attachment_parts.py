"""A message's file and image parts resolved: files looked up, documents extracted, images read
and checked, and the message rendered with each document's text in place.

`file` parts become their extracted text between a header and a footer (media/extraction.py:
cached per file, so the next turn renders the same prompt and hits the prefix cache; the most
recently used texts also in memory, media/text_memory.py, so a conversation's files are not read
from disk again every turn); a file sent inline is decoded and read the same way
(api/inline_files.py), its text kept in memory by its bytes' hash; images are
checked from their headers and, for a vision model's answer, named by their bytes' sha256 for
api/image_job.py to decode (a token count keeps their place, a remote one unfetched). A file or
image referenced many times in a request is read and checked once (`Seen`). Counting parts, refusing images for a model
without vision and fitting documents to the context are api/attachments.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from api import inline_files
from api.errors import ApiError, bad_request, not_found, overloaded
from api.image_job import ImageSource, ReadImage, image_errors
from api.parts import FilePart, ImagePart, InlineFilePart, TextPart
from api.protocol import ChatMessage
from engine.types import IMAGE_PLACEHOLDER
from media import documents, extraction, images
from media.text_memory import TextMemory
from media.workers import run_blocking
from settings import FilesConfig, ImagesConfig
from store.blobs import Blobs, is_file_id
from store.types import StoredFile

if TYPE_CHECKING:
    from store.store import Store


@dataclass(slots=True)
class Seen:
    """What one request has read, by file id (an image without one by its URL): a file or image
    referenced many times is looked up, read and checked once."""

    files: dict[str, StoredFile] = field(default_factory=dict)
    documents: dict[str, Document] = field(default_factory=dict)
    image_sources: dict[str, ImageSource] = field(default_factory=dict)
    read_images: dict[str, ReadImage] = field(default_factory=dict)
    # A stored history's images that no longer pass their checks (by image_key): rendered "[image]".
    unreadable_images: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class AttachContext:
    """One request's access to files and images (made per request: `seen` is that request's)."""

    store: Store
    blobs: Blobs
    org_id: str
    files: FilesConfig
    images: ImagesConfig
    texts: TextMemory
    seen: Seen = field(default_factory=Seen)


@dataclass(frozen=True, slots=True)
class Document:
    key: str  # the file id; a file sent inline: inline_files.InlineFile.key
    file_id: str | None  # None: sent inline
    filename: str
    media_type: str
    doc: documents.DocumentText


@dataclass(slots=True)
class Resolved:
    """One message's parts, resolved: documents (by part index) and images read (for a vision model's answer)."""

    message: ChatMessage
    documents: dict[int, Document]
    images: list[ReadImage]
    with_images: bool = False  # a vision model: images keep their place (IMAGE_PLACEHOLDER)


# Images are counted first (no bytes read, api/attachments.py), then each is read and its header
# checked (a bad image gets its own 400), and only then, for a vision model, decoded (api/image_job.py,
# once the prompt is fitted): a model without vision is refused before any pixel is decoded.
async def _owned(ctx: AttachContext, file_id: str, where: str) -> StoredFile:
    stored = ctx.seen.files.get(file_id)
    if stored is None and is_file_id(file_id):
        stored = await ctx.store.get_file(ctx.org_id, file_id)
    if stored is None:
        raise not_found(f"No such File object: {file_id} ('{where}').", param=where)
    ctx.seen.files[file_id] = stored
    return stored


async def stored_files(ctx: AttachContext, message: ChatMessage) -> dict[int, StoredFile]:
    """The message's file parts by index, looked up (404 for an unknown or another organisation's id)."""
    return {i: await _owned(ctx, p.file_id, p.where) for i, p in enumerate(message.parts) if isinstance(p, FilePart)}


def image_parts(message: ChatMessage, stored: dict[int, StoredFile]) -> dict[int, ImagePart | FilePart]:
    """The message's images by part index: image parts, and file parts whose upload is an image."""
    return {
        i: p
        for i, p in enumerate(message.parts)
        if isinstance(p, ImagePart)
        or (isinstance(p, FilePart) and i in stored and stored[i].media_type.startswith("image/"))
    }


def _limits(cfg: FilesConfig) -> documents.ExtractLimits:
    return documents.ExtractLimits(
        cfg.max_pdf_pages, cfg.max_document_chars, cfg.max_extract_s, cfg.max_extract_memory_bytes
    )


async def _document(ctx: AttachContext, stored: StoredFile, where: str) -> Document:
    if stored.id in ctx.seen.documents:
        return ctx.seen.documents[stored.id]
    limits = _limits(ctx.files)
    doc = ctx.texts.get(stored.id, limits)
    if doc is None:
        with _extraction_errors(ctx, f"{stored.filename} ({stored.id})", where):
            doc = await extraction.cached_extract(
                ctx.blobs.path(stored.id),
                ctx.blobs.text_path(stored.id),
                stored.media_type,
                limits,
                ctx.files.max_concurrent_extractions,
            )
        ctx.texts.put(stored.id, limits, doc)
    ctx.seen.documents[stored.id] = Document(stored.id, stored.id, stored.filename, stored.media_type, doc)
    return ctx.seen.documents[stored.id]


async def _inline_document(ctx: AttachContext, part: InlineFilePart) -> Document:
    """A file sent inline: decoded and checked (off the loop: up to max_file_bytes), then read as
    an upload is, unless its text is in memory (an earlier turn, or earlier in this request)."""
    file = await run_blocking(inline_files.decode, part, ctx.files.max_file_bytes)
    if file.key in ctx.seen.documents:
        return ctx.seen.documents[file.key]
    limits = _limits(ctx.files)
    doc = ctx.texts.get(file.key, limits)
    if doc is None:
        with _extraction_errors(ctx, file.filename, part.param):
            doc = await inline_files.read(file, ctx.blobs, limits, ctx.files.max_concurrent_extractions)
        ctx.texts.put(file.key, limits, doc)
    ctx.seen.documents[file.key] = Document(file.key, None, file.filename, file.media_type, doc)
    return ctx.seen.documents[file.key]


@contextlib.contextmanager
def _extraction_errors(ctx: AttachContext, name: str, where: str) -> Iterator[None]:
    try:
        yield
    except documents.UnreadableDocument as exc:
        raise bad_request(f"The file {name} cannot be read: {exc}.", param=where, code="unreadable_file") from None
    except extraction.ExtractionBusy as exc:
        raise overloaded(
            f"The server is busy reading other files ({exc}); try again shortly.",
            retry_after_s=ctx.files.max_extract_s,
        ) from None


async def is_readable_image(ctx: AttachContext, part: ImagePart) -> bool:
    """Whether a stored history's image still passes its checks (a 400 now: read as "[image]");
    remembered in `ctx.seen`. Its source is kept there for the message's resolve."""
    key = image_key(part)
    if key in ctx.seen.unreadable_images:
        return False
    try:
        await _image_source(ctx, part, fetch=True)
    except ApiError as exc:
        if exc.status != 400:
            raise
        ctx.seen.unreadable_images.add(key)
        return False
    return True


def image_key(part: ImagePart | FilePart) -> str:
    """The same image however often a request names it: its file id, else its URL."""
    return part.file_id if part.file_id is not None else part.url or ""


async def _image_source(ctx: AttachContext, part: ImagePart | FilePart, fetch: bool) -> ImageSource | None:
    """The image's bytes or path, its size, structure, format and pixel count checked (once per
    request for each image, however often it is named). Not `fetch` (a token count): a remote
    URL is only checked against the settings (scheme, fetching on, host allowed), not fetched (None)."""
    cfg, where, key = ctx.images, part.where, image_key(part)
    if key in ctx.seen.image_sources:
        return ctx.seen.image_sources[key]
    with image_errors(where):
        if isinstance(part, FilePart):  # its upload was looked up already (stored_files)
            source: ImageSource = ctx.blobs.path(part.file_id)
        elif part.file_id is not None:
            source = ctx.blobs.path((await _owned(ctx, part.file_id, where)).id)
        elif part.url is None:  # parse_parts gives an image part a file_id or a url
            raise bad_request(f"'{where}' has neither a file_id nor a url.", param=where)
        elif part.url.startswith("data:"):
            source = images.decode_data_url(part.url, cfg)
        elif not fetch:
            images.check_remote_url(part.url, cfg)
            return None
        else:
            source = await images.fetch_remote(part.url, cfg)
        await images.probe_bounded(source, cfg)
    ctx.seen.image_sources[key] = source
    return source


async def image_sources(
    ctx: AttachContext, message: ChatMessage, stored: dict[int, StoredFile], *, fetch: bool = True
) -> dict[int, ImageSource]:
    """The message's images read and checked, by part index (not `fetch`: remote ones checked, left out)."""
    sources = {i: await _image_source(ctx, p, fetch) for i, p in image_parts(message, stored).items()}
    return {i: source for i, source in sources.items() if source is not None}


async def resolve_from(
    ctx: AttachContext,
    message: ChatMessage,
    stored: dict[int, StoredFile],
    sources: dict[int, ImageSource] | None,
    *,
    decode: bool = True,
) -> Resolved:
    """Documents extracted; images read for the answer (`ReadImage`: decoded by api/image_job.py)
    when `sources` holds them (None: a model without vision, whose images render as "[image]").
    Not `decode` (a token count): the images keep their place, IMAGE_PLACEHOLDER, which the
    model's tokenizer counts as its image tokens, none read for decoding."""
    image_at = image_parts(message, stored)
    documents_by_index: dict[int, Document] = {}
    read: list[ReadImage] = []
    for i, part in enumerate(message.parts):
        if i in image_at:
            if sources is not None and decode:
                read.append(await _read(ctx, image_at[i], sources[i]))
        elif isinstance(part, FilePart):
            documents_by_index[i] = await _document(ctx, stored[i], part.where)
        elif isinstance(part, InlineFilePart):
            documents_by_index[i] = await _inline_document(ctx, part)
    return Resolved(message, documents_by_index, read, sources is not None)


async def _read(ctx: AttachContext, part: ImagePart | FilePart, source: ImageSource) -> ReadImage:
    """The image with its bytes' digest, which names it in the model's prepared images
    (api/image_job.py decodes it there, only when it is in the prompt and not prepared already)."""
    key = image_key(part)
    if key not in ctx.seen.read_images:
        ctx.seen.read_images[key] = ReadImage(source, await run_blocking(images.digest_of, source), part.where, key)
    return ctx.seen.read_images[key]


async def resolve(
    ctx: AttachContext, message: ChatMessage, *, with_images: bool = False, decode: bool = True
) -> Resolved:
    stored = await stored_files(ctx, message)
    sources = await image_sources(ctx, message, stored, fetch=decode) if with_images else None
    return await resolve_from(ctx, message, stored, sources, decode=decode)


def render(resolved: Resolved, texts: dict[int, str] | None = None) -> str:
    """The message's text with each document's block in place (`texts` overrides a document's text)."""
    segments: list[str] = []
    after_text = False  # consecutive text parts join with nothing between them, as plain content does
    for i, part in enumerate(resolved.message.parts):
        if isinstance(part, TextPart):
            if after_text:
                segments[-1] += part.text
            else:
                segments.append(part.text)
            after_text = True
            continue
        after_text = False
        if i in resolved.documents:
            d = resolved.documents[i]
            text = d.doc.text if texts is None or i not in texts else texts[i]
            name = d.filename
            segments.append(f"{documents.header(name, d.media_type, d.doc)}\n{text}\n{documents.footer(name)}")
        else:
            segments.append(IMAGE_PLACEHOLDER if resolved.with_images else "[image]")
    return "\n\n".join(s for s in segments if s)
