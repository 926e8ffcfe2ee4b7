"""Files and images of a chat request turned into model input, and documents fitted to the context.

Owns step 3's attachment half: each `file` part becomes its extracted text between a header
and a footer (cached per file, so the next turn renders the same prompt and hits the prefix
cache); each image is fetched, checked and decoded; a model without vision gets a 400 naming
it. A document that does not fit the context is refused with the numbers, or cut to fit when
the request says `truncation: "auto"` (the answer then lists what was left out).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from api import image_job
from api.errors import ApiError, bad_request, not_found
from api.job import Job, JobInputs, encode_chat, make_job
from api.parts import FilePart, ImagePart, Part, TextPart, parse_parts, to_json
from api.protocol import ChatMessage
from engine.torch_threads import side_executor
from engine.types import IMAGE_PLACEHOLDER
from media import documents, images
from settings import FilesConfig, ImagesConfig
from store.blobs import Blobs, is_file_id
from store.types import Message, StoredFile

if TYPE_CHECKING:
    from store.store import Store

_MAX_FIT_TRIES = 3


@dataclass(frozen=True, slots=True)
class AttachContext:
    store: Store
    blobs: Blobs
    org_id: str
    files: FilesConfig
    images: ImagesConfig


@dataclass(frozen=True, slots=True)
class Document:
    stored: StoredFile
    doc: documents.DocumentText


@dataclass(frozen=True, slots=True)
class TruncatedFile:
    file_id: str
    filename: str
    num_tokens: int
    num_tokens_kept: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class Resolved:
    """One message's parts, resolved: documents (by part index) and decoded images."""

    message: ChatMessage
    documents: dict[int, Document]
    images: list[images.DecodedImage]
    with_images: bool = False  # a vision model: images keep their place (IMAGE_PLACEHOLDER)


# -- resolving parts ---------------------------------------------------------------------
async def _owned(ctx: AttachContext, file_id: str, where: str) -> StoredFile:
    stored = await ctx.store.get_file(ctx.org_id, file_id) if is_file_id(file_id) else None
    if stored is None:
        raise not_found(f"No such File object: {file_id} ('{where}').", param=where)
    return stored


async def _document(ctx: AttachContext, stored: StoredFile, where: str) -> Document:
    try:
        limits = documents.ExtractLimits(ctx.files.max_pdf_pages, ctx.files.max_document_chars)
        doc = await asyncio.to_thread(
            documents.cached_extract,
            ctx.blobs.path(stored.id),
            ctx.blobs.text_path(stored.id),
            stored.media_type,
            limits,
        )
    except documents.UnreadableDocument as exc:
        raise bad_request(
            f"The file {stored.filename} ({stored.id}) cannot be read: {exc}.", param=where, code="unreadable_file"
        ) from None
    return Document(stored, doc)


async def _image(ctx: AttachContext, part: ImagePart | StoredFile, where: str) -> images.DecodedImage:
    cfg = ctx.images
    try:
        if isinstance(part, StoredFile):
            data = await asyncio.to_thread(ctx.blobs.path(part.id).read_bytes)
        elif part.file_id is not None:
            stored = await _owned(ctx, part.file_id, where)
            data = await asyncio.to_thread(ctx.blobs.path(stored.id).read_bytes)
        elif part.url is None:  # parse_parts gives an image part a file_id or a url
            raise bad_request(f"'{where}' has neither a file_id nor a url.", param=where)
        elif part.url.startswith("data:"):
            data = images.decode_data_url(part.url, cfg)
        else:
            data = await images.fetch_remote(part.url, cfg)
        return await asyncio.to_thread(images.decode, data, cfg)
    except images.ImageRejected as exc:
        raise bad_request(f"{exc.message} ('{where}')", param=where, code=exc.code) from None


async def resolve(ctx: AttachContext, message: ChatMessage, *, with_images: bool = False) -> Resolved:
    documents_by_index: dict[int, Document] = {}
    decoded: list[images.DecodedImage] = []
    for i, part in enumerate(message.parts):
        if isinstance(part, FilePart):
            stored = await _owned(ctx, part.file_id, part.where)
            if stored.media_type.startswith("image/"):
                decoded.append(await _image(ctx, stored, part.where))
            else:
                documents_by_index[i] = await _document(ctx, stored, part.where)
        elif isinstance(part, ImagePart):
            decoded.append(await _image(ctx, part, part.where))
    return Resolved(message, documents_by_index, decoded, with_images)


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
            name = d.stored.filename
            segments.append(f"{documents.header(name, d.stored.media_type, d.doc)}\n{text}\n{documents.footer(name)}")
        else:
            segments.append(IMAGE_PLACEHOLDER if resolved.with_images else "[image]")
    return "\n\n".join(s for s in segments if s)


# -- fitting documents to the context ------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Prepared:
    job: Job
    truncated: tuple[TruncatedFile, ...]


def _with_texts(inputs: JobInputs, resolved: list[Resolved], texts: dict[tuple[int, int], str]) -> JobInputs:
    messages = []
    for m_index, r in enumerate(resolved):
        if not r.message.parts:
            messages.append(r.message)
            continue
        own = {i: t for (m, i), t in texts.items() if m == m_index}
        messages.append(ChatMessage(r.message.role, render(r, own)))
    return dataclasses.replace(inputs, chat=dataclasses.replace(inputs.chat, messages=tuple(messages)))


def _doc_tokens(inputs: JobInputs, resolved: list[Resolved]) -> dict[tuple[int, int], list[int]]:
    tok = inputs.model.tokenizer
    return {(m, i): tok.encode(d.doc.text) for m, r in enumerate(resolved) for i, d in r.documents.items()}


def _too_long(inputs: JobInputs, resolved: list[Resolved], ids: dict, room: int) -> ApiError:
    limit = min(inputs.model.max_model_len, inputs.tier.max_context_tokens)
    sizes = ", ".join(f"{resolved[m].documents[i].stored.filename} is {len(t)} tokens" for (m, i), t in ids.items())
    return ApiError(
        400,
        f"The attached files do not fit this model's context of {limit} tokens: {sizes}; with the rest of the"
        f" request, about {max(room, 0)} tokens of files fit. Send a shorter file, or set 'truncation': 'auto'"
        f" to cut the files to fit. (model: {inputs.model.name})",
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
    )


def _budget(inputs: JobInputs) -> tuple[int, int]:
    """(context limit, tokens kept for the answer) when documents are cut to fit."""
    limit = min(inputs.model.max_model_len, inputs.tier.max_context_tokens)
    return limit, inputs.chat.max_tokens or min(inputs.tier.max_tokens, max(limit // 4, 1))


def _num_prompt_tokens(inputs: JobInputs, resolved: list[Resolved], texts: dict) -> int:
    fitted = _with_texts(inputs, resolved, texts)
    context = [*(inputs.history or ()), *fitted.chat.messages]
    return len(encode_chat(inputs.model, context, (), inputs.chat.chat_template_kwargs))


def _room_for_documents(inputs: JobInputs, resolved: list[Resolved], ids: dict) -> int:
    """Tokens left for document text once everything else (headers included) is counted."""
    limit, reserve = _budget(inputs)
    return limit - reserve - _num_prompt_tokens(inputs, resolved, dict.fromkeys(ids, ""))


def _cut(inputs: JobInputs, resolved: list[Resolved], ids: dict, room: int) -> tuple[dict, list[TruncatedFile]]:
    """Keep documents whole in order while they fit; cut the first that does not, drop the rest."""
    tok = inputs.model.tokenizer
    texts, cut = {}, []
    for (m, i), doc_ids in ids.items():
        keep = max(0, min(len(doc_ids), room))
        room -= keep
        if keep < len(doc_ids):
            d = resolved[m].documents[i]
            note = (
                f"[... {len(doc_ids) - keep} of this file's {len(doc_ids)} tokens were left out to fit the context ...]"
            )
            texts[(m, i)] = f"{tok.decode(doc_ids[:keep])}\n{note}"
            cut.append(TruncatedFile(d.stored.id, d.stored.filename, len(doc_ids), keep))
    return texts, cut


def fit(inputs: JobInputs, resolved: list[Resolved]) -> Prepared:
    """make_job with the documents whole, or cut to fit when the request allows it."""
    try:
        return Prepared(make_job(_with_texts(inputs, resolved, {})), ())
    except ApiError as exc:
        if exc.code != "context_length_exceeded" or not any(r.documents for r in resolved):
            raise
        original = exc
    ids = _doc_tokens(inputs, resolved)
    room = _room_for_documents(inputs, resolved, ids)
    if inputs.chat.truncation != "auto":
        raise _too_long(inputs, resolved, ids, room)
    if room <= 0:
        raise original  # even without the files the request does not fit
    limit, reserve = _budget(inputs)
    for _ in range(_MAX_FIT_TRIES):  # the cut notes and re-tokenized text add a few tokens: measure, shrink
        texts, cut = _cut(inputs, resolved, ids, room)
        excess = _num_prompt_tokens(inputs, resolved, texts) + reserve - limit
        if excess <= 0:
            return Prepared(make_job(_with_texts(inputs, resolved, texts)), tuple(cut))
        room -= excess
    raise original


# -- the entry point from the chat handler ------------------------------------------------
def _check_images(inputs: JobInputs, resolved: list[Resolved], cfg: ImagesConfig, prompter) -> None:
    num_images = sum(len(r.images) for r in resolved)
    if num_images == 0:
        return
    if num_images > cfg.max_images_per_request:
        raise bad_request(
            f"The request carries {num_images} images; the limit is {cfg.max_images_per_request}.",
            param="messages",
            code="too_many_images",
        )
    if prompter is None:
        where = next(p.where for r in resolved for p in r.message.parts if isinstance(p, (ImagePart, FilePart)))
        raise bad_request(
            f"The model '{inputs.model.name}' does not accept images; send text or files, or use a vision model.",
            param=where,
            code="image_input_not_supported",
        )


OFF_LOOP_CHARS = 32_768  # prompts this long are tokenized on a worker thread


def _num_chars(inputs: JobInputs, new: list[Resolved]) -> int:
    """The prompt's text: messages (with the stored history) and the attached documents."""
    history = inputs.history or ()
    text = sum(len(m.content) for m in (*history, *inputs.chat.messages))
    return text + sum(len(d.doc.text) for r in new for d in r.documents.values())


async def prepare_job(ctx: AttachContext, inputs: JobInputs) -> Prepared:
    """Resolve the new messages' attachments (and the history's), then tokenize and fit."""
    prompter = image_job.prompter_of(inputs.model)
    new = [await resolve(ctx, m, with_images=prompter is not None) for m in inputs.chat.messages]
    _check_images(inputs, new, ctx.images, prompter)
    history, history_images = None, []
    if inputs.history is not None:
        rendered = [await _history_message(ctx, m, prompter is not None) for m in inputs.history]
        history = tuple(r.message for r in rendered)
        history_images = [img for r in rendered for img in r.images]
    fitted = dataclasses.replace(inputs, history=history)
    if _num_chars(fitted, new) < OFF_LOOP_CHARS:
        prepared = fit(fitted, new)
    else:  # tokenizing a long prompt takes tens to hundreds of ms: not on the loop other streams share
        prepared = await asyncio.get_running_loop().run_in_executor(side_executor(), fit, fitted, new)
    job = prepared.job
    if prompter is not None:
        await image_job.place_images(job, prompter, [*history_images, *(img for r in new for img in r.images)])
    job.new_messages = tuple((m.role, m.content) for m in inputs.chat.messages)
    job.new_message_parts = tuple(
        orjson.dumps(to_json(m.parts)).decode() if m.parts else None for m in inputs.chat.messages
    )
    return prepared


async def _history_message(ctx: AttachContext, message: ChatMessage, with_images: bool) -> Resolved:
    """A stored message with parts renders as it did on its own turn (so the prefix cache hits);
    a deleted file says so; images stay images for a vision model (remote ones are not fetched again)."""
    if not message.parts:
        return Resolved(message, {}, [])
    kept: list[Part] = []
    for part in message.parts:
        file_id = part.file_id if isinstance(part, (FilePart, ImagePart)) else None
        if file_id is not None and await ctx.store.get_file(ctx.org_id, file_id) is None:
            kept.append(TextPart(f"\n[The file {file_id} is no longer available.]\n"))
        elif isinstance(part, ImagePart) and (
            not with_images or not (part.file_id or (part.url or "").startswith("data:"))
        ):
            kept.append(TextPart("[image]"))
        else:
            kept.append(part)
    resolved = await resolve(ctx, ChatMessage(message.role, message.content, tuple(kept)), with_images=with_images)
    return Resolved(ChatMessage(message.role, render(resolved)), {}, resolved.images)


def history_message(m: Message) -> ChatMessage:
    """A stored message as a chat message, with its parts when it was sent with attachments."""
    if m.parts_json is None:
        return ChatMessage(m.role, m.content)
    parts: tuple[Part, ...] = parse_parts(orjson.loads(m.parts_json), "history")
    return ChatMessage(m.role, m.content, parts)
