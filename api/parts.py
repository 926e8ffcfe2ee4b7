"""Content parts of a chat message: text, files and images, parsed into typed parts.

Owns the wire shapes OpenAI's chat API uses for parts (`text`, `file` with a `file_id`,
`image_url` with a `data:`/http(s) URL, or a `file_id` as this server's extension) and their
validation errors. Nothing here reads files, decodes images or touches the store.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from api.errors import bad_request

TRUNCATION_MODES = ("disabled", "auto")


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
class ImagePart:
    url: str | None  # data: or http(s) URL
    file_id: str | None  # an uploaded file (extension); exactly one of url/file_id is set
    detail: ImageDetail
    where: str


Part = TextPart | FilePart | ImagePart


def parse_parts(value: list[Any], where: str) -> tuple[Part, ...]:
    """Validate an array of content parts; raise 400 naming the part on any problem."""
    return tuple(_part(part, f"{where}[{i}]") for i, part in enumerate(value))


def text_of(parts: tuple[Part, ...]) -> str:
    return "".join(p.text for p in parts if isinstance(p, TextPart))


def has_attachments(parts: tuple[Part, ...]) -> bool:
    return any(not isinstance(p, TextPart) for p in parts)


def to_json(parts: tuple[Part, ...]) -> list[dict]:
    """The parts in their wire shape (stored with a conversation's message)."""
    out: list[dict] = []
    for p in parts:
        if isinstance(p, TextPart):
            out.append({"type": "text", "text": p.text})
        elif isinstance(p, FilePart):
            out.append({"type": "file", "file": {"file_id": p.file_id}})
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


def _file_part(value: Any, where: str) -> FilePart:
    if not isinstance(value, dict):
        raise bad_request(f"'{where}.file' must be an object with a 'file_id'.", param=where)
    file_id = value.get("file_id")
    if isinstance(file_id, str) and file_id:
        return FilePart(file_id, where)
    if "file_data" in value:
        raise bad_request(
            f"'{where}.file.file_data' is not supported: upload the file with POST /v1/files and send its 'file_id'.",
            param=f"{where}.file.file_data",
            code="unsupported_value",
        )
    raise bad_request(f"'{where}.file.file_id' must be a non-empty string.", param=f"{where}.file.file_id")


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
