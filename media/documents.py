"""Uploaded documents turned into text: plain text files as they are, PDFs through pypdf.

Owns the readers (blocking; a PDF is read in a child process, media/extraction.py) and the
per-file cache format (a JSON file beside the upload, written once), so the same file gives
the same text on every turn and the prompt's prefix stays cacheable. It does not decide where
the text goes in the prompt or how much of it fits.
"""

from __future__ import annotations

import codecs
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

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
# Longest first: UTF-32 LE's BOM starts with UTF-16 LE's.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


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
    max_extract_s: float  # a PDF reader's deadline (media/extraction.py)
    max_memory_bytes: int  # a PDF reader's address space (media/pdf_worker.py)

    @property
    def reader_limits(self) -> list[float]:
        """What a refused PDF's cache entry is kept under (besides `max_pdf_pages`, `max_chars`)."""
        return [self.max_extract_s, self.max_memory_bytes]


def is_text_type(media_type: str) -> bool:
    return media_type.startswith("text/") or media_type in TEXT_TYPES


def is_pdf(media_type: str) -> bool:
    return media_type == "application/pdf"


def read_text(path: Path, media_type: str, limits: ExtractLimits) -> DocumentText:
    """A text file's text, cut to `limits.max_chars` (blocking; bounded by the upload size limit)."""
    with path.open("rb") as fh:
        head = fh.read(_SNIFF_BYTES)
    encoding = next((name for bom, name in _BOMS if head.startswith(bom)), None)
    if encoding is None and not is_text_type(media_type) and b"\0" in head:
        raise UnreadableDocument(f"files of type {media_type} cannot be read as text; send text or PDF files")
    raw = path.read_bytes()
    if encoding is None and b"\0" in raw:  # UTF-16 and UTF-32 hold NUL bytes; other text does not
        raise UnreadableDocument("the file holds binary data (NUL bytes), not text")
    try:
        text = raw.decode(encoding or "utf-8-sig")  # utf-16/utf-32 read and drop the BOM
    except UnicodeDecodeError:
        raise UnreadableDocument(f"the file is not valid {(encoding or 'utf-8').upper()} text") from None
    if "\0" in text:
        raise UnreadableDocument("the file holds binary data (NUL characters), not text")
    return cut(DocumentText(text, None, None), limits.max_chars)


def read_pdf(path: Path, limits: ExtractLimits) -> DocumentText:
    """A PDF's text page by page, cut to `limits.max_chars` (blocking, unbounded time: run it in
    a child process with a deadline, media/extraction.py)."""
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, LimitReachedError, PyPdfError

    try:
        reader = PdfReader(path)
        if reader.is_encrypted:
            raise UnreadableDocument("the PDF is encrypted; send it without a password")
        num_pages = len(reader.pages)
        pages = [reader.pages[i].extract_text() or "" for i in range(min(num_pages, limits.max_pdf_pages))]
    except DependencyError as exc:  # pypdf decrypts AES only with the `cryptography` package, not installed here
        if "AES" in str(exc):
            raise UnreadableDocument("the PDF is encrypted; send it without a password") from None
        raise UnreadableDocument(f"the PDF needs a decoder this server lacks ({exc})") from None
    except LimitReachedError as exc:  # decompression bombs, reference loops: pypdf stops at its limits
        raise UnreadableDocument(f"reading the PDF reached a safety limit ({exc})") from None
    except MemoryError:  # the reader's address space is capped (media/pdf_worker.py)
        raise UnreadableDocument(
            "reading the PDF needs more memory than this server allows (files.max_extract_memory_bytes)"
        ) from None
    except (PyPdfError, ValueError, KeyError, TypeError) as exc:
        raise UnreadableDocument(f"the PDF cannot be read ({type(exc).__name__}: {exc})") from None
    if num_pages == 0:
        raise UnreadableDocument("the PDF has no pages")
    if not any(page.strip() for page in pages):
        num = f"{len(pages)} pages" if len(pages) > 1 else "page"
        raise UnreadableDocument(
            f"no text could be extracted from its {num} (a scanned PDF holds only pictures of text, and this "
            "server does not do OCR); send a PDF with a text layer, or the text itself"
        )
    text = "\n\n".join(f"[Page {i + 1}]\n{page.strip()}" for i, page in enumerate(pages))
    return cut(DocumentText(text, num_pages, len(pages)), limits.max_chars)


def cut(doc: DocumentText, max_chars: int) -> DocumentText:
    if len(doc.text) <= max_chars:
        return doc
    return DocumentText(doc.text[:max_chars], doc.num_pages, doc.num_pages_read, len(doc.text))


# -- the cache file beside the upload ---------------------------------------------------------
# {"text", "num_pages", "num_pages_read", "num_chars", "limits": [max_pdf_pages, max_chars]} for
# a document; {"error", "limits", "reader_limits"} for a refusal (a refused PDF is not read again
# on every turn until a limit changes: a slow one would take its full deadline each time).
def read_cache(cache_path: Path, limits: ExtractLimits) -> DocumentText | None:
    """The cached text (None: not cached under these limits); raises a cached refusal (blocking)."""
    try:
        cached = json.loads(cache_path.read_text(encoding="utf-8"))
        if cached["limits"] != [limits.max_pdf_pages, limits.max_chars]:
            return None
        if "error" in cached:
            if cached["reader_limits"] != limits.reader_limits:
                return None
            raise UnreadableDocument(cached["error"])
        return DocumentText(cached["text"], cached["num_pages"], cached["num_pages_read"], cached["num_chars"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def write_cache(
    cache_path: Path, limits: ExtractLimits, result: DocumentText | UnreadableDocument, source: Path | None = None
) -> None:
    """Remember a text or a refusal (blocking). Concurrent writers each use a temp file of their
    own, so the last rename wins whole; a crash can leave `<name>.<random>.tmp` behind, which
    store/blobs.py sweeps. `source`: the file read; deleted meanwhile (its reading takes up to
    files.max_extract_s), its text is not kept either."""
    entry: dict = {"limits": [limits.max_pdf_pages, limits.max_chars]}
    if isinstance(result, UnreadableDocument):
        entry.update(error=str(result), reader_limits=limits.reader_limits)
    else:
        entry.update(text=result.text, num_pages=result.num_pages, num_pages_read=result.num_pages_read)
        entry.update(num_chars=result.num_chars)
    temp = cache_path.with_name(f"{cache_path.name}.{secrets.token_hex(8)}.tmp")
    try:
        temp.write_text(json.dumps(entry), encoding="utf-8")
        os.replace(temp, cache_path)
        if source is not None and not source.exists():  # deleted after this check: its delete removes this
            cache_path.unlink(missing_ok=True)
    finally:
        temp.unlink(missing_ok=True)


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
