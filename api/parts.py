"""Content parts of a chat message: text, files and images, parsed into typed parts.

Owns the wire shapes OpenAI's chat API uses for parts (`text`, `file` with a `file_id` or a
`file_data` data: URL sent inline, `image_url` with a `data:`/http(s) URL, or a `file_id` as this
server's extension) and their validation errors. Nothing here reads files, decodes images or
data: URLs, or touches the store (api/inline_files.py decodes an inline file).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace
from typing import Any

from api.errors import bad_request
from api.fields import kind_of

TRUNCATION_MODES = ("disabled", "auto")
# data:<media type>[;param=value]*;base64,<payload>: the shape is checked here, the payload decoded later.
_DATA_URL = re.compile(r"^data:(?P<type>[a-z0-9.+-]+/[a-z0-9.+-]+)?(?:;[a-z0-9-]+=[^;,]*)*;base64,", re.IGNORECASE)


class ImageDetail(enum.Enum):
    AUTO = "auto"
    LOW = "low"
    HIGH = "high"


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class FilePart:
    file_id: str
    where: str  # e.g. messages[1].content[0], for errors


@dataclass(frozen=True, slots=True)
class InlineFilePart:
    """A file sent in the request itself: a base64 data: URL (chat's `file_data`, the Responses
    API's `input_file.file_data`, an Anthropic `document` block's source). It is kept as sent, so
    a stored conversation's message holds it and the next turn reads it again."""

    data_url: str
    filename: str | None  # as the client named it; None: unnamed
    param: str  # the field its errors name, as the client spelled it (e.g. messages[1].content[0].file.file_data)

    @property
    def media_type(self) -> str | None:
        """The type the data: URL declares (the bytes' magic decides first, api/inline_files.py)."""
        match = _DATA_URL.match(self.data_url)
        return match.group("type").lower() if match and match.group("type") else None

    @property
    def payload(self) -> str:
        """The base64 text after the comma."""
        return self.data_url.partition(",")[2]


@dataclass(frozen=True, slots=True)
class ImagePart:
    url: str | None  # data: or http(s) URL
    file_id: str | None  # an uploaded file (extension); exactly one of url/file_id is set
    detail: ImageDetail
    where: str


Part = TextPart | FilePart | InlineFilePart | ImagePart
FILE_PARTS = (FilePart, InlineFilePart)  # what files.max_files_per_request counts


def parse_parts(value: list[Any], where: str) -> tuple[Part, ...]:
    """Validate an array of content parts; raise 400 naming the part on any problem."""
    return tuple(_part(part, f"{where}[{i}]") for i, part in enumerate(value))


def text_of(parts: tuple[Part, ...]) -> str:
    return "".join(p.text for p in parts if isinstance(p, TextPart))


def has_attachments(parts: tuple[Part, ...]) -> bool:
    return any(not isinstance(p, TextPart) for p in parts)


def is_data_url(text: str) -> bool:
    """A base64 data: URL as a file part's `file_data` must be (its payload is decoded later)."""
    return _DATA_URL.match(text) is not None


def num_inline_chars(parts: tuple[Part, ...]) -> int:
    """The characters of the files sent inline (stored with the message when the turn is)."""
    return sum(len(p.data_url) for p in parts if isinstance(p, InlineFilePart))


def named(part: Part, where: str) -> Part:
    """The part with its errors naming `where` (a field of the request as its API spells it, when
    that is not the chat message it became: an Anthropic block, a Responses input item)."""
    if isinstance(part, InlineFilePart):
        return replace(part, param=where)
    if isinstance(part, (FilePart, ImagePart)):
        return replace(part, where=where)
    return part


def to_json(parts: tuple[Part, ...]) -> list[dict]:
    """The parts in their wire shape (stored with a conversation's message)."""
    out: list[dict] = []
    for p in parts:
        if isinstance(p, TextPart):
            out.append({"type": "text", "text": p.text})
        elif isinstance(p, FilePart):
            out.append({"type": "file", "file": {"file_id": p.file_id}})
        elif isinstance(p, InlineFilePart):
            name = {} if p.filename is None else {"filename": p.filename}
            out.append({"type": "file", "file": {**name, "file_data": p.data_url}})
        else:
            ref = {"url": p.url} if p.url is not None else {"file_id": p.file_id}
            out.append({"type": "image_url", "image_url": {**ref, "detail": p.detail.value}})
    return out


def parse_truncation(raw: dict[str, Any]) -> str:
    value = raw.get("truncation", "disabled")
    if value not in TRUNCATION_MODES:
        raise bad_request(
            f"'truncation' must be 'disabled' (a file too long for the context is refused) or 'auto' (it is cut"
            f" to fit); got {value!r}.",
            param="truncation",
        )
    return value


def _part(part: Any, where: str) -> Part:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return TextPart(part["text"])
    if kind == "text":
        raise bad_request(f"'{where}.text' must be a string (the part's text).", param=f"{where}.text")
    if kind == "file":
        return _file_part(part.get("file"), where)
    if kind == "image_url":
        return _image_part(part.get("image_url"), where)
    raise bad_request(
        f"'{where}' must be a content part of type text, file or image_url; got {_describe(part)}.",
        param=where,
        code="unsupported_value",
    )


def _file_part(value: Any, where: str) -> FilePart | InlineFilePart:
    if not isinstance(value, dict):
        raise bad_request(f"'{where}.file' must be an object with a 'file_id' or a 'file_data'.", param=where)
    file_id = value.get("file_id")
    if "file_data" in value and file_id is None:
        return _inline_file(value, where)
    if isinstance(file_id, str) and file_id and "file_data" not in value:
        return FilePart(file_id, where)
    if "file_url" in value:  # the Responses API's input_file.file_url
        raise bad_request(
            f"'{where}.file.file_url' is not supported: this server does not fetch files from URLs; send the file"
            " inline as 'file_data' (a base64 data: URL) or upload it with POST /v1/files and send its 'file_id'.",
            param=f"{where}.file.file_url",
            code="file_url_not_allowed",
        )
    raise bad_request(
        f"'{where}.file.file_id' must be a non-empty string (an uploaded file's id); or send the file inline as"
        " 'file_data' (a base64 data: URL such as data:application/pdf;base64,...) instead: exactly one of them.",
        param=f"{where}.file.file_id",
    )


def _inline_file(value: dict, where: str) -> InlineFilePart:
    data, filename, param = value["file_data"], value.get("filename"), f"{where}.file.file_data"
    if not isinstance(data, str) or not is_data_url(data):
        raise bad_request(
            f"'{param}' must be a base64 data: URL such as data:application/pdf;base64,JVBERi0...; got {_head(data)}.",
            param=param,
            code="invalid_file_data",
        )
    if filename is not None and not isinstance(filename, str):
        raise bad_request(f"'{where}.file.filename' must be a string.", param=f"{where}.file.filename")
    return InlineFilePart(data, filename or None, param)


def _head(value: Any) -> str:
    if not isinstance(value, str):
        return kind_of(value)
    return repr(value[:40] + ("..." if len(value) > 40 else ""))


def _image_part(value: Any, where: str) -> ImagePart:
    if not isinstance(value, dict):
        raise bad_request(f"'{where}.image_url' must be an object with a 'url'.", param=where)
    detail_text = value.get("detail", "auto")
    try:
        detail = ImageDetail(detail_text)
    except ValueError:
        raise bad_request(
            f"'{where}.image_url.detail' must be auto, low or high; got {detail_text!r}.",
            param=f"{where}.image_url.detail",
        ) from None
    url, file_id = value.get("url"), value.get("file_id")
    if isinstance(file_id, str) and file_id and url is None:
        return ImagePart(None, file_id, detail, where)
    if isinstance(url, str) and url and file_id is None:
        return ImagePart(url, None, detail, where)
    raise bad_request(
        f"'{where}.image_url' needs exactly one of 'url' (a data: or http(s) URL) or 'file_id' (an uploaded image).",
        param=f"{where}.image_url",
    )


def _describe(part: Any) -> str:
    if isinstance(part, dict):
        return f"type {part.get('type')!r}"
    return type(part).__name__
