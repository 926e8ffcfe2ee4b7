"""What an exported conversation looks like: its Markdown text, its attachments' names, and the
download's filename (Content-Disposition) made safe from its title.

Pure functions over the conversation object GET renders (api/conversation_objects.py); nothing
here reads the store or knows about requests.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import quote

MAX_FILENAME_CHARS = 80  # of the name before its extension
MAX_FILENAME_BYTES = 150  # of that name in UTF-8: filesystems allow 255 bytes, the extension and a " (2)" fit
# Path separators, quotes, and what Windows forbids in a name; `%` and `;` too, as some browsers
# decode %xx in a plain filename="..." and `;` ends a header parameter in naive parsers.
_UNSAFE = re.compile(r"""[/\\"'<>:|?*%;`]""")
# Control, format (bidi overrides that disguise an extension), separator and surrogate characters.
_INVISIBLE = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")
_WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def content_disposition(title: str | None, fallback: str, extension: str) -> str:
    """`attachment; filename="..."` named after the title (`fallback`, ASCII, when it leaves nothing),
    with RFC 6266's `filename*=UTF-8''...` beside an ASCII-only `filename` when the name is not ASCII."""
    stem = safe_stem(title or "") or fallback
    name = f"{stem}.{extension}"
    if name.isascii():
        return f'attachment; filename="{name}"'
    ascii_stem = safe_stem(unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode()) or fallback
    return f"attachment; filename=\"{ascii_stem}.{extension}\"; filename*=UTF-8''{quote(name, safe='')}"


def safe_stem(title: str) -> str:
    """The title as a file's name without extension: no path separators, quotes or invisible
    characters, whitespace collapsed, no leading or trailing dots (never `..` or a hidden file),
    at most MAX_FILENAME_CHARS characters and MAX_FILENAME_BYTES bytes; '' when nothing is left."""
    text = "".join(" " if unicodedata.category(ch) in _INVISIBLE else ch for ch in unicodedata.normalize("NFC", title))
    text = _UNSAFE.sub("_", " ".join(text.split()))
    text = re.sub(r"_{2,}", "_", text)[:MAX_FILENAME_CHARS]
    while len(text.encode()) > MAX_FILENAME_BYTES:
        text = text[:-1]
    text = text.strip(" ._-")
    return f"{text}_" if text.upper() in _WINDOWS_RESERVED else text


def attachment_names(parts: list, file_names: dict[str, str]) -> list[str]:
    """The names of a stored message's attachments (its non-text parts, in the shape api/parts.py
    stores): an uploaded file's name from `file_names` (file id -> filename; a file since deleted
    or expired keeps its id), an inline file's own name, else `document` or `image`."""
    names = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "file":
            ref = part.get("file") or {}
            file_id = ref.get("file_id")
            names.append(file_names.get(file_id, file_id) if file_id else ref.get("filename") or "document")
        elif part.get("type") == "image_url":
            file_id = (part.get("image_url") or {}).get("file_id")
            names.append(file_names.get(file_id, "image") if file_id else "image")
    return names


def file_ids_of(parts: list) -> list[str]:
    """The uploaded files (ids) a stored message's parts refer to."""
    ids = []
    for part in parts:
        if isinstance(part, dict) and part.get("type") in ("file", "image_url"):
            ref = part.get("file") if part["type"] == "file" else part.get("image_url")
            if isinstance(ref, dict) and isinstance(ref.get("file_id"), str):
                ids.append(ref["file_id"])
    return ids


def markdown_document(conversation: dict) -> str:
    """`# Title`, then each message under a bold **User** / **Assistant (model)** line, its text
    as written (an answer's Markdown stays Markdown), and its attachments listed by name."""
    title = " ".join((conversation.get("title") or "Untitled").split())
    lines = [f"# {title}", ""]
    for message in conversation["messages"]:
        lines += [f"**{_speaker(message)}**", ""]
        if message["content"]:
            lines += [_close_open_fence(message["content"]).rstrip("\n"), ""]
        if message.get("attachments"):
            lines += ["Attachments:", "", *(f"- {_code_span(name)}" for name in message["attachments"])]
            lines.append("")
    return "\n".join(lines)


def _code_span(text: str) -> str:
    """A name as literal Markdown: a code span, its backtick run longer than any inside the name."""
    text = " ".join(text.split())
    ticks = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _speaker(message: dict) -> str:
    role = str(message["role"]).capitalize()
    return f"{role} ({message['model']})" if message["role"] == "assistant" and message.get("model") else role


def _close_open_fence(text: str) -> str:
    """The text with a code fence it left open (an answer cut off mid-block) closed, so that the
    messages after it are not read as code."""
    open_fence: str | None = None
    for line in text.split("\n"):
        match = _FENCE.match(line)
        if match is None:
            continue
        fence = match.group(1)
        if open_fence is None:
            open_fence = fence
        elif fence[0] == open_fence[0] and len(fence) >= len(open_fence) and not line[match.end() :].strip():
            open_fence = None
    return text if open_fence is None else f"{text.rstrip(chr(10))}\n{open_fence}"
