"""Files and images of a chat request turned into model input, and documents fitted to the context.

Owns step 3's attachment half: `file` parts and images are counted, then resolved
(api/attachment_parts.py: documents extracted, images read and checked, decoded only for a
vision model): a model without vision gets a 400 naming it before any pixel is decoded; a token
count makes the same checks, its images kept in place as the model's image tokens, none decoded. A
document that does not fit the context is refused with the numbers, or cut to fit when the
request says `truncation: "auto"` (the answer then lists what was left out); one certainly
longer than the room is bounded (engine/token_bound.py), never tokenized whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
import structlog

from api import image_job
from api import tools as tooling
from api.attachment_parts import (
    AttachContext,
    Resolved,
    image_parts,
    image_sources,
    is_readable_image,
    render,
    resolve,
    resolve_from,
    stored_files,
)
from api.errors import ApiError, bad_request
from api.job import Job, JobInputs, make_job
from api.parts import FILE_PARTS, FilePart, ImagePart, Part, TextPart, parse_parts, to_json
from api.prompt import encode_chat
from api.protocol import ChatMessage
from engine.tokenizer import PromptTooLong, Tokenizer
from engine.torch_threads import side_executor
from settings import FilesConfig, ImagesConfig
from store.types import Message

if TYPE_CHECKING:
    from engine.registry import ModelHandle
    from engine.upstream.counting import Counter

log = structlog.get_logger(__name__)

_MAX_FIT_TRIES = 3
_CHARS_PER_TOKEN_GUESS = 4  # the first prefix tried when the start of a document is kept (then doubled)


@dataclass(frozen=True, slots=True)
class TruncatedFile:
    file_id: str | None  # None: a file sent inline
    filename: str
    num_tokens: int
    num_tokens_kept: int
    num_tokens_is_lower_bound: bool = False  # the file was not tokenized whole: it holds at least num_tokens

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- fitting documents to the context ------------------------------------------------------
DocKey = tuple[int, int]  # (message index, part index)


@dataclass(frozen=True, slots=True)
class Prepared:
    job: Job
    truncated: tuple[TruncatedFile, ...]


@dataclass(frozen=True, slots=True)
class DocTokens:
    """A document's size: counted, or (a text certainly longer than the room for documents) a
    lower bound from the tokenizer's bound (engine/token_bound.py), the text not tokenized."""

    num_tokens: int
    is_lower_bound: bool = False

    def __str__(self) -> str:
        return f"{'at least ' if self.is_lower_bound else ''}{self.num_tokens} tokens"


def _with_texts(inputs: JobInputs, resolved: list[Resolved], texts: dict[DocKey, str]) -> JobInputs:
    messages = []
    for m_index, r in enumerate(resolved):
        if not r.message.parts:
            messages.append(r.message)
            continue
        own = {i: t for (m, i), t in texts.items() if m == m_index}
        messages.append(ChatMessage(r.message.role, render(r, own)))
    return dataclasses.replace(inputs, chat=dataclasses.replace(inputs.chat, messages=tuple(messages)))


def _doc_tokens(inputs: JobInputs, resolved: list[Resolved], room: int) -> dict[DocKey, DocTokens]:
    """Each document's size against `room`, each file counted once however often it is attached."""
    by_file: dict[str, DocTokens] = {}
    for r in resolved:
        for d in r.documents.values():
            if d.key not in by_file:
                by_file[d.key] = _count(inputs.model.tokenizer, d.doc.text, room)
    return {(m, i): by_file[d.key] for m, r in enumerate(resolved) for i, d in r.documents.items()}


def _count(tok: Tokenizer | Counter, text: str, room: int) -> DocTokens:
    """Tokenized and counted when the text may fit `room`; bounded when it certainly does not."""
    if not isinstance(tok, Tokenizer):  # a relayed model's counter: no bound
        return DocTokens(len(tok.encode(text)))
    try:
        ids = tok.encode_prompt(text, max_num_tokens=max(room, 0))
    except PromptTooLong as exc:
        return DocTokens(exc.num_tokens, is_lower_bound=exc.is_lower_bound)
    return DocTokens(len(ids) - len(tok.encode_prompt("")))  # less what a prompt gets added (a BOS)


def _too_long(inputs: JobInputs, resolved: list[Resolved], sizes: dict[DocKey, DocTokens], room: int) -> ApiError:
    limit = min(inputs.model.max_model_len, inputs.tier.max_context_tokens)
    named = dict.fromkeys(f"{resolved[m].documents[i].filename} is {size}" for (m, i), size in sizes.items())
    return ApiError(
        400,
        f"The attached files do not fit this model's context of {limit} tokens: {', '.join(named)}; with the rest"
        f" of the request, about {max(room, 0)} tokens of files fit. Send a shorter file, or set 'truncation':"
        f" 'auto' to cut the files to fit. (model: {inputs.model.name})",
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
    )


def _budget(inputs: JobInputs) -> tuple[int, int]:
    """(context limit, tokens kept for the answer) when documents are cut to fit."""
    limit = min(inputs.model.max_model_len, inputs.tier.max_context_tokens)
    return limit, inputs.chat.max_tokens or min(inputs.tier.max_tokens, max(limit // 4, 1))


def _num_prompt_tokens(
    inputs: JobInputs, resolved: list[Resolved], texts: dict, max_num_tokens: int | None = None
) -> int:
    """`max_num_tokens`: PromptTooLong for a prompt certainly longer (not tokenized)."""
    fitted = _with_texts(inputs, resolved, texts)
    context = [*(inputs.history or ()), *fitted.chat.messages]
    return len(encode_chat(inputs.model, context, (), inputs.chat.chat_template_kwargs, False, max_num_tokens))


def _room_for_documents(inputs: JobInputs, resolved: list[Resolved], keys: list[DocKey]) -> int:
    """Tokens left for document text once everything else (headers included) is counted; below
    zero when the rest does not fit (the rest certainly longer than the room is not tokenized)."""
    limit, reserve = _budget(inputs)
    try:
        return limit - reserve - _num_prompt_tokens(inputs, resolved, dict.fromkeys(keys, ""), limit - reserve)
    except PromptTooLong as exc:
        return limit - reserve - exc.num_tokens


def _first_ids(tok: Tokenizer | Counter, text: str, num_tokens: int) -> list[int]:
    """The ids of the text's first `num_tokens` tokens, from a prefix that holds more (tried at a
    few characters a token, doubled until it does): a long document is not tokenized whole."""
    num_chars = _CHARS_PER_TOKEN_GUESS * num_tokens
    while True:
        ids = tok.encode(text[:num_chars])
        if len(ids) > num_tokens or num_chars >= len(text):
            return ids[:num_tokens]
        num_chars *= 2


def _cut(
    inputs: JobInputs, resolved: list[Resolved], sizes: dict[DocKey, DocTokens], room: int
) -> tuple[dict[DocKey, str], list[TruncatedFile]]:
    """Keep documents whole in order while they fit; cut the first that does not, drop the rest.
    (A bounded size is above the room: such a document is never kept whole.)"""
    tok = inputs.model.tokenizer
    texts, cut = {}, []
    for (m, i), size in sizes.items():
        n = size.num_tokens
        keep = max(0, min(n, room))
        room -= keep
        if keep == n:
            continue
        d = resolved[m].documents[i]
        left_out = (
            f"all but the first {keep} of this file's at least" if size.is_lower_bound else f"{n - keep} of this file's"
        )
        note = f"[... {left_out} {n} tokens were left out to fit the context ...]"
        texts[(m, i)] = f"{tok.decode(_first_ids(tok, d.doc.text, keep) if keep else [])}\n{note}"
        cut.append(TruncatedFile(d.file_id, d.filename, n, keep, size.is_lower_bound))
    return texts, cut


def fit(inputs: JobInputs, resolved: list[Resolved]) -> Prepared:
    """make_job with the documents whole, or cut to fit when the request allows it."""
    try:
        return Prepared(make_job(_with_texts(inputs, resolved, {})), ())
    except ApiError as exc:
        if exc.code != "context_length_exceeded" or not any(r.documents for r in resolved):
            raise
        original = exc
    keys = [(m, i) for m, r in enumerate(resolved) for i in r.documents]
    sized, room = inputs, _room_for_documents(inputs, resolved, keys)
    if room <= 0 and inputs.history:  # the whole stored history leaves none: make_job drops its oldest turns
        sized = dataclasses.replace(inputs, history=())
        room = _room_for_documents(sized, resolved, keys)
    sizes = _doc_tokens(sized, resolved, room)
    if inputs.chat.truncation != "auto":
        raise _too_long(inputs, resolved, sizes, room)
    if room <= 0:
        raise original  # even without the files the request does not fit
    limit, reserve = _budget(inputs)
    for _ in range(_MAX_FIT_TRIES):  # the cut notes and re-tokenized text add a few tokens: measure, shrink
        texts, cut = _cut(inputs, resolved, sizes, room)
        excess = _num_prompt_tokens(sized, resolved, texts) + reserve - limit
        if excess <= 0:
            return Prepared(make_job(_with_texts(inputs, resolved, texts)), tuple(cut))
        room -= excess
    raise original


# -- the entry point from the chat handler ------------------------------------------------
def _check_file_count(messages: tuple[ChatMessage, ...], cfg: FilesConfig) -> None:
    """`messages`: the request's own, not a stored history's (its files are bounded otherwise: each
    read once and kept, looked up in one read a turn, only those the organisation still keeps)."""
    num_files = sum(isinstance(p, FILE_PARTS) for m in messages for p in m.parts)  # uploaded or sent inline
    if num_files > cfg.max_files_per_request:
        raise bad_request(
            f"The request carries {num_files} file parts; the limit is {cfg.max_files_per_request}"
            " (files.max_files_per_request; files in a conversation's earlier turns do not count).",
            param="messages",
            code="too_many_files",
        )


def _check_image_count(num_images: int, cfg: ImagesConfig) -> None:
    if num_images > cfg.max_images_per_request:
        raise bad_request(
            f"The request carries {num_images} images; the limit is {cfg.max_images_per_request}.",
            param="messages",
            code="too_many_images",
        )


def _no_vision(model: ModelHandle, where: str) -> ApiError:
    return bad_request(
        f"The model '{model.name}' does not accept images; send text or files, or use a vision model.",
        param=where,
        code="image_input_not_supported",
    )


OFF_LOOP_CHARS = 32_768  # prompts this long are tokenized on a worker thread


def _num_chars(inputs: JobInputs, new: list[Resolved]) -> int:
    """The prompt's text: messages (with the stored history and the instructions), tools, the
    attached documents; a legacy completion's token ids count one each (checked and decoded)."""
    chat = inputs.chat
    text = sum(len(m.content) for m in (*(inputs.history or ()), *chat.instructions, *chat.messages))
    ids = len(chat.raw_prompt) if isinstance(chat.raw_prompt, tuple) else 0
    return text + ids + tooling.num_chars(chat.tools) + sum(len(d.doc.text) for r in new for d in r.documents.values())


async def _resolve_new(
    ctx: AttachContext, model: ModelHandle, messages: tuple[ChatMessage, ...], num_inline_history: int, *, decode: bool
) -> list[Resolved]:
    """The request's messages resolved under the answer's checks, in its order: the file count, the
    files' owners, the image count, each image read and checked, then a model without vision refused.
    A vision model's images are decoded; not `decode` (a token count): they keep their place
    undecoded, a remote one checked against the settings but not fetched (api/attachment_parts.py)."""
    prompter = image_job.prompter_of(model)
    _check_file_count(messages[num_inline_history:], ctx.files)  # before any file is looked up
    stored = [await stored_files(ctx, m) for m in messages]
    wheres = [p.where for m, s in zip(messages, stored, strict=True) for p in image_parts(m, s).values()]
    _check_image_count(len(wheres), ctx.images)  # before any image is read
    sources = [await image_sources(ctx, m, s, fetch=decode) for m, s in zip(messages, stored, strict=True)]
    if wheres and prompter is None:  # read and checked, not decoded
        raise _no_vision(model, wheres[0])
    return [
        await resolve_from(ctx, m, s, src if prompter is not None else None, decode=decode)
        for m, s, src in zip(messages, stored, sources, strict=True)
    ]


async def prepare_job(ctx: AttachContext, inputs: JobInputs) -> Prepared:
    """Resolve the new messages' attachments (and the history's), then tokenize and fit. A stored
    history's image that no longer decodes is read as "[image]" and the prompt fitted again: an
    old turn never makes every later turn of its conversation a 400."""
    new = await _resolve_new(ctx, inputs.model, inputs.chat.messages, inputs.chat.num_history_messages, decode=True)
    while True:
        try:
            prepared = await _fit_with_images(ctx, inputs, new)
            break
        except image_job.UnreadableHistoryImage as exc:
            if exc.key in ctx.seen.unreadable_images:  # rendered as text already: never again
                raise exc.error from None
            log.warning("history_image_unreadable", error=exc.error.message)
            ctx.seen.unreadable_images.add(exc.key)
    job = prepared.job
    job.new_messages = tuple((m.role, m.content) for m in inputs.chat.messages)
    job.new_message_parts = tuple(
        orjson.dumps(to_json(m.parts)).decode() if m.parts else None for m in inputs.chat.messages
    )
    return prepared


async def _fit_with_images(ctx: AttachContext, inputs: JobInputs, new: list[Resolved]) -> Prepared:
    """The history rendered (its unreadable images as "[image]"), the prompt fitted, then the
    images still in it decoded (or found prepared) and placed."""
    prompter = image_job.prompter_of(inputs.model)
    history, history_images = None, []
    if inputs.history is not None:
        rendered = await _rendered_history(ctx, inputs.history, with_images=prompter is not None)
        history = tuple(r.message for r in rendered)
        history_images = [img for r in rendered for img in r.images]
    prepared = await _fit_off_loop(dataclasses.replace(inputs, history=history), new)
    if prompter is not None:
        new_images = [img for r in new for img in r.images]
        await image_job.place_images(prepared.job, prompter, [*history_images, *new_images], ctx.images)
    return prepared


async def prepare_count(ctx: AttachContext, inputs: JobInputs) -> Job:
    """The job `inputs` would make, for a token count (nothing generated): the files read and the
    prompt fitted to the context as prepare_job fits it (fit: a stored history's oldest turns
    dropped, documents cut or refused per `truncation`, the same 400s). A vision model's images
    count as its image tokens, each checked as for an answer but neither decoded nor fetched; a
    model without vision refuses them as there."""
    with_images = image_job.prompter_of(inputs.model) is not None
    new = await _resolve_new(ctx, inputs.model, inputs.chat.messages, inputs.chat.num_history_messages, decode=False)
    history = None
    if inputs.history is not None:
        rendered = await _rendered_history(ctx, inputs.history, with_images, decode=False)
        history = tuple(r.message for r in rendered)
    return (await _fit_off_loop(dataclasses.replace(inputs, history=history), new)).job


async def _fit_off_loop(inputs: JobInputs, new: list[Resolved]) -> Prepared:
    """fit; a long prompt on a worker thread (tokenizing it takes tens to hundreds of ms: not on
    the loop other streams share)."""
    if _num_chars(inputs, new) < OFF_LOOP_CHARS:
        return fit(inputs, new)
    return await asyncio.get_running_loop().run_in_executor(side_executor(), fit, inputs, new)


async def _rendered_history(
    ctx: AttachContext, history: tuple[ChatMessage, ...], with_images: bool, *, decode: bool = True
) -> list[Resolved]:
    await _look_up_files(ctx, history)
    return [await _history_message(ctx, m, with_images, decode) for m in history]


async def _look_up_files(ctx: AttachContext, messages: tuple[ChatMessage, ...]) -> None:
    """The stored history's files, looked up in one read into `ctx.seen` (resolving them then
    asks the store nothing): a long conversation's files cost no read each."""
    file_ids = dict.fromkeys(
        p.file_id for m in messages for p in m.parts if isinstance(p, (FilePart, ImagePart)) and p.file_id is not None
    )
    missing = [file_id for file_id in file_ids if file_id not in ctx.seen.files]
    if missing:
        ctx.seen.files.update(await ctx.store.get_files(ctx.org_id, missing))


async def _history_message(ctx: AttachContext, message: ChatMessage, with_images: bool, decode: bool) -> Resolved:
    """A stored message with parts renders as it did on its own turn (so the prefix cache hits);
    a deleted file says so; images stay images for a vision model (remote ones are not fetched again:
    "[image]"), decoded unless for a token count. Its files were looked up already (`_look_up_files`)."""
    if not message.parts:
        return Resolved(message, {}, [])
    kept: list[Part] = []
    for part in message.parts:
        file_id = part.file_id if isinstance(part, (FilePart, ImagePart)) else None
        if file_id is not None and file_id not in ctx.seen.files:
            kept.append(TextPart(f"\n[The file {file_id} is no longer available.]\n"))
        elif isinstance(part, ImagePart) and (
            not with_images
            or not (part.file_id or (part.url or "").startswith("data:"))
            or not await is_readable_image(ctx, part)  # stored, then a limit changed; or imported so
        ):
            kept.append(TextPart("[image]"))
        else:
            kept.append(part)
    kept_message = ChatMessage(message.role, message.content, tuple(kept))
    resolved = await resolve(ctx, kept_message, with_images=with_images, decode=decode)
    return Resolved(ChatMessage(message.role, render(resolved)), {}, resolved.images)


async def read_files(ctx: AttachContext, model: ModelHandle, messages: tuple[ChatMessage, ...]) -> list[ChatMessage]:
    """The messages with each file's text in place, as a token count reads them for `model`
    (nothing generated), under an answer's checks (file and image counts, the file's owner, the
    readers' limits and refusals, each image checked, a model without vision refusing images).
    A vision model's images keep their place (its image tokens), neither decoded nor fetched."""
    new = await _resolve_new(ctx, model, messages, 0, decode=False)
    return [ChatMessage(r.message.role, render(r)) if r.message.parts else r.message for r in new]


def history_message(m: Message) -> ChatMessage:
    """A stored message as a chat message, with its parts when it was sent with attachments."""
    if m.parts_json is None:
        return ChatMessage(m.role, m.content)
    parts: tuple[Part, ...] = parse_parts(orjson.loads(m.parts_json), "history")
    return ChatMessage(m.role, m.content, parts)
