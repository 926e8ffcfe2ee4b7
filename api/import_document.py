"""What POST /v1/conversations/import reads: one conversation as the JSON export writes it
(GET /v1/conversations/{id}/export?format=json), or the export of them all (`{"object": "list",
"data": [...]}`), checked whole into the store's `ImportedConversation`s before anything is written.

Pure: no store, no request. Every error is a 400 naming the field as the file spells it
(`data[2].messages[5].role`) and the limit; the file's ids, and what its server counted (usage,
feedback, fallbacks, attachment names), are not read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

from api.errors import bad_request
from api.export_format import file_ids_of
from api.fields import MAX_TITLE_CHARS, check_metadata, kind_of
from api.parts import ImagePart, InlineFilePart, Part, parse_parts, to_json
from store.conversations import new_message_id
from store.types import ImportedConversation, Message

MAX_IMPORT_CONVERSATIONS = 10_000  # in one request
MAX_IMPORT_MESSAGES = 100_000  # in one request, all its conversations together
MAX_MODEL_CHARS = 256  # an answer's model name
MAX_TOKENS = 2**31 - 1  # an answer's completion tokens
ROLES = ("user", "assistant", "system", "developer", "tool")  # what conversations store
FINISH_REASONS = ("stop", "length", "abort", "content_filter", "error")  # what answers store
_DOCUMENT_HINT = (
    "a conversation as GET /v1/conversations/{id}/export?format=json writes it, or the list "
    "GET /v1/conversations/export writes"
)


@dataclass(frozen=True, slots=True)
class ImportLimits:
    max_message_chars: int  # server.max_prompt_chars: a stored message came in as (or answered) one prompt
    max_conversations: int  # MAX_IMPORT_CONVERSATIONS
    max_messages: int  # MAX_IMPORT_MESSAGES, all the conversations' together


@dataclass(frozen=True, slots=True)
class ImportDocument:
    conversations: tuple[ImportedConversation, ...]  # in the file's order
    source_ids: tuple[str | None, ...]  # each one's id in the file, when it gives a string
    num_messages: int
    num_chars: int  # what they add to the organisation's stored conversations (its storage cap's count)
    file_ids: tuple[str, ...]  # uploaded files their messages' parts name, each once
    # Their inline files and data: URL images, each naming its field: read before the write, as a turn reads them.
    attachments: tuple[InlineFilePart | ImagePart, ...]


def parse_document(raw: Any, limits: ImportLimits, now: float) -> ImportDocument:
    """The conversations `raw` holds, checked against `limits`; a 400 naming the first problem.
    Times after `now` (another machine's clock) become `now`."""
    items, wheres = _conversation_items(raw, limits)
    conversations: list[ImportedConversation] = []
    num_messages = 0
    for i, (item, where) in enumerate(zip(items, wheres, strict=True)):
        messages = item.get("messages")
        num_messages += len(messages) if isinstance(messages, list) else 0  # else _conversation's 400
        if num_messages > limits.max_messages:
            raise bad_request(
                f"The document holds more than {limits.max_messages} messages (passed at '{_at(where, 'messages')}'); "
                f"import at most {limits.max_messages} at a time.",
                param=_at(where, "messages"),
                code="array_above_max_length",
            )
        conversations.append(_conversation(item, where, limits, _Order(i, len(items), now)))
    parts_json = [m.parts_json for c in conversations for m in c.messages if m.parts_json is not None]
    return ImportDocument(
        conversations=tuple(conversations),
        source_ids=tuple(item["id"] if isinstance(item.get("id"), str) else None for item in items),
        num_messages=num_messages,
        num_chars=sum(len(m.content) for c in conversations for m in c.messages) + sum(map(len, parts_json)),
        file_ids=tuple(dict.fromkeys(i for text in parts_json for i in file_ids_of(orjson.loads(text)))),
        attachments=tuple(a for c, where in zip(conversations, wheres, strict=True) for a in _attachments(c, where)),
    )


def _attachments(conversation: ImportedConversation, where: str) -> Iterator[InlineFilePart | ImagePart]:
    """The conversation's inline files and data: URL images, named as the file spells their fields
    (an uploaded file's id is looked up each turn, a remote image is never fetched again)."""
    for j, m in enumerate(conversation.messages):
        if m.parts_json is not None:
            parts = parse_parts(orjson.loads(m.parts_json), f"{_at(where, 'messages')}[{j}].parts")
            yield from (p for p in parts if isinstance(p, InlineFilePart) or _is_data_image(p))


def _is_data_image(part: Part) -> TypeGuard[ImagePart]:
    return isinstance(part, ImagePart) and part.url is not None and part.url.startswith("data:")


def _conversation_items(raw: Any, limits: ImportLimits) -> tuple[list[dict], list[str]]:
    """The conversation objects and where each is (`data[i]`, or '' for a document of one)."""
    if not isinstance(raw, dict):
        raise bad_request(f"The request body must be a JSON object: {_DOCUMENT_HINT}.")
    kind = raw.get("object")
    if kind not in ("list", "conversation", None):
        raise bad_request(
            f"'object' must be 'list' (every conversation) or 'conversation' (one), got {kind!r}: {_DOCUMENT_HINT}.",
            param="object",
        )
    if kind != "list":
        return [raw], [""]
    items = raw.get("data")
    if not isinstance(items, list):
        raise bad_request(f"'data' must be an array of conversations, got {kind_of(items)}.", param="data")
    if len(items) > limits.max_conversations:
        raise bad_request(
            f"'data' holds {len(items)} conversations; import at most {limits.max_conversations} at a time.",
            param="data",
            code="array_above_max_length",
        )
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"'data[{i}]' must be a conversation object, got {kind_of(item)}.", param=f"data[{i}]")
    return items, [f"data[{i}]" for i in range(len(items))]


@dataclass(frozen=True, slots=True)
class _Order:
    """Conversation `index` of `count` in the file, read at `now`."""

    index: int
    count: int
    now: float

    def spread(self, t: float) -> float:
        """`t`, never after `now`. Exports write whole seconds: a time without a fraction is moved
        into its second (up to `now`) by the conversation's place in the file, the first the latest,
        so that conversations of one second list in the file's order (the export's, newest created
        first), not by their new ids."""
        if float(t).is_integer():
            room = min(max(self.now - t, 0.0), 1.0)
            t += room * (self.count - self.index) / (self.count + 1)
        return min(t, self.now)


def _conversation(item: dict, where: str, limits: ImportLimits, order: _Order) -> ImportedConversation:
    raw_messages = item.get("messages")
    if not isinstance(raw_messages, list):
        param = _at(where, "messages")
        raise bad_request(f"'{param}' must be an array of messages, got {kind_of(raw_messages)}.", param=param)
    metadata = item.get("metadata")
    check_metadata(metadata, _at(where, "metadata"))
    created_at = _time(item.get("created_at"), _at(where, "created_at"), default=order.now)
    messages = tuple(
        _message(m, f"{_at(where, 'messages')}[{j}]", limits, created_at, order.now) for j, m in enumerate(raw_messages)
    )
    latest = max([created_at, *(m.created_at for m in messages)])
    updated_at = _time(item.get("updated_at"), _at(where, "updated_at"), default=latest)
    return ImportedConversation(
        title=_title(item.get("title"), _at(where, "title")),
        created_at=order.spread(created_at),
        updated_at=order.spread(updated_at),
        metadata=dict(metadata or {}),
        messages=messages,
    )


def _title(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{param}' must be a string or null, got {kind_of(value)}.", param=param)
    if len(value) > MAX_TITLE_CHARS:
        raise bad_request(
            f"'{param}' may have at most {MAX_TITLE_CHARS} characters, got {len(value)}.",
            param=param,
            code="string_above_max_length",
        )
    return value.strip() or None


def _time(value: Any, param: str, default: float) -> float:
    """Unix seconds (a number >= 0); `default` when absent or null."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise bad_request(f"'{param}' must be a unix time in seconds (a number >= 0), got {value!r}.", param=param)
    return float(value)


def _message(raw: Any, where: str, limits: ImportLimits, default_time: float, now: float) -> Message:
    """One message under a new id; `default_time` when it gives no `created_at`."""
    if not isinstance(raw, dict):
        raise bad_request(f"'{where}' must be a message object, got {kind_of(raw)}.", param=where)
    role, content = raw.get("role"), raw.get("content")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}; got {role!r}.", param=f"{where}.role")
    if not isinstance(content, str):
        raise bad_request(f"'{where}.content' must be a string, got {kind_of(content)}.", param=f"{where}.content")
    if len(content) > limits.max_message_chars:
        raise bad_request(
            f"'{where}.content' holds {len(content)} characters; the limit is {limits.max_message_chars} "
            "(server.max_prompt_chars).",
            param=f"{where}.content",
            code="string_above_max_length",
        )
    model, tokens, finish_reason = _answer_fields(raw, where)
    is_answer = role == "assistant"  # the store keeps these for answers only
    return Message(
        id=new_message_id(),
        role=role,
        content=content,
        created_at=min(_time(raw.get("created_at"), f"{where}.created_at", default=default_time), now),
        tokens=tokens if is_answer else None,
        model=model if is_answer else None,
        parts_json=_parts_json(raw.get("parts"), role, f"{where}.parts"),
        finish_reason=finish_reason if is_answer else None,
    )


def _answer_fields(raw: dict, where: str) -> tuple[str | None, int | None, str | None]:
    """An answer's `model`, `tokens` (its completion tokens) and `finish_reason`, each optional."""
    model, tokens, finish_reason = raw.get("model"), raw.get("tokens"), raw.get("finish_reason")
    if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_CHARS):
        raise bad_request(
            f"'{where}.model' must be a model's name (a string of at most {MAX_MODEL_CHARS} characters) or null.",
            param=f"{where}.model",
        )
    is_count = isinstance(tokens, int) and not isinstance(tokens, bool) and 0 <= tokens <= MAX_TOKENS
    if tokens is not None and not is_count:
        raise bad_request(
            f"'{where}.tokens' must be a whole number from 0 to {MAX_TOKENS} or null, got {tokens!r}.",
            param=f"{where}.tokens",
        )
    if finish_reason is not None and finish_reason not in FINISH_REASONS:
        raise bad_request(
            f"'{where}.finish_reason' must be one of {', '.join(FINISH_REASONS)} or null; got {finish_reason!r}.",
            param=f"{where}.finish_reason",
        )
    return model, tokens, finish_reason


def _parts_json(value: Any, role: str, param: str) -> str | None:
    """A user message's attachments as the store keeps them (api/parts.py's shapes, checked the way
    a chat request's are); null or [] for none. A file id stays as it is: every read of a file is
    by the organisation's own ids, so one this organisation lacks shows as no longer available."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise bad_request(f"'{param}' must be an array of content parts or null, got {kind_of(value)}.", param=param)
    if role != "user":
        raise bad_request(f"'{param}': only user messages carry parts; this one's role is {role}.", param=param)
    return orjson.dumps(to_json(parse_parts(value, param))).decode()


def _at(where: str, field: str) -> str:
    return f"{where}.{field}" if where else field
