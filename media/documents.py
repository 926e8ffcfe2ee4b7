"""Uploaded documents turned into text: plain text files as they are, PDFs through pypdf.

Owns extraction and its per-file cache (a JSON file beside the upload, written once), so the
same file gives the same text on every turn and the prompt's prefix stays cacheable. It
does not decide where the text goes in the prompt or how much of it fits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

TEXT_TYPES = (
    "application/json",
    "application/xml",
    "application/x-yaml",
    "application/yaml",
    "application/javascript",
    "application/x-sh",
    "application/sql",
    "application/csv",
)
_SNIFF_BYTES = 8192


class UnreadableDocument(Exception):
    """The file is not a text or PDF document this server can read (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class DocumentText:
    text: str
    num_pages: int | None  # PDFs only
    num_pages_read: int | None  # fewer than num_pages when the page limit cut it
    num_chars: int | None = None  # the whole text's length when max_document_chars cut it, else None


@dataclass(frozen=True, slots=True)
class ExtractLimits:
    max_pdf_pages: int
    max_chars: int


def is_text_type(media_type: str) -> bool:
    return media_type.startswith("text/") or media_type in TEXT_TYPES


def extract(path: Path, media_type: str, max_pdf_pages: int) -> DocumentText:
    """The document's text (blocking: call it in a thread)."""
    if media_type == "application/pdf":
        return _pdf_text(path, max_pdf_pages)
    head = path.open("rb").read(_SNIFF_BYTES)
    if not is_text_type(media_type) and b"\0" in head:
        raise UnreadableDocument(f"files of type {media_type} cannot be read as text; send text or PDF files")
    raw = path.read_bytes()
    if b"\0" in raw:
        raise UnreadableDocument("the file holds binary data (NUL bytes), not text")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UnreadableDocument("the file is not valid UTF-8 text") from None
    return DocumentText(text, None, None)


def _pdf_text(path: Path, max_pages: int) -> DocumentText:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(path)
        if reader.is_encrypted:
            raise UnreadableDocument("the PDF is encrypted")
        num_pages = len(reader.pages)
        pages = [reader.pages[i].extract_text() or "" for i in range(min(num_pages, max_pages))]
    except (PdfReadError, ValueError, KeyError, TypeError) as exc:
        raise UnreadableDocument(f"the PDF cannot be read ({type(exc).__name__}: {exc})") from None
    text = "\n\n".join(f"[Page {i + 1}]\n{page.strip()}" for i, page in enumerate(pages))
    return DocumentText(text, num_pages, len(pages))


def cached_extract(path: Path, cache_path: Path, media_type: str, limits: ExtractLimits) -> DocumentText:
    """`extract` cut to `limits.max_chars`, remembered in `cache_path` (blocking: call it in a thread)."""
    try:
        cached = json.loads(cache_path.read_text(encoding="utf-8"))
        if cached["limits"] == [limits.max_pdf_pages, limits.max_chars]:
            return DocumentText(cached["text"], cached["num_pages"], cached["num_pages_read"], cached["num_chars"])
    except (FileNotFoundError, ValueError, KeyError):
        pass
    doc = extract(path, media_type, limits.max_pdf_pages)
    if len(doc.text) > limits.max_chars:
        doc = DocumentText(doc.text[: limits.max_chars], doc.num_pages, doc.num_pages_read, len(doc.text))
    temp = cache_path.with_suffix(".tmp")
    temp.write_text(
        json.dumps(
            {
                "text": doc.text,
                "num_pages": doc.num_pages,
                "num_pages_read": doc.num_pages_read,
                "num_chars": doc.num_chars,
                "limits": [limits.max_pdf_pages, limits.max_chars],
            }
        ),
        encoding="utf-8",
    )
    os.replace(temp, cache_path)
    return doc


def header(filename: str, media_type: str, doc: DocumentText) -> str:
    """The line that introduces a document in the prompt."""
    notes = [media_type] if doc.num_pages is None else ["PDF", f"{doc.num_pages} pages"]
    if doc.num_pages_read is not None and doc.num_pages is not None and doc.num_pages_read < doc.num_pages:
        notes.append(f"the first {doc.num_pages_read} read")
    if doc.num_chars is not None:
        notes.append(f"the first {len(doc.text)} of {doc.num_chars} characters")
    return f"--- File: {filename} ({', '.join(notes)}) ---"


def footer(filename: str) -> str:
    return f"--- End of file: {filename} ---"
