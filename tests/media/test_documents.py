"""Document readers and the extraction cache, without a server: UTF-16/32 text with a BOM is
read and other binary is not, damaged or encrypted or scanned PDFs are refused naming the
problem, refusals are remembered per limits, and concurrent cache writers never collide."""

from __future__ import annotations

import dataclasses
import os

import pytest

from media import documents
from media.documents import DocumentText, ExtractLimits, UnreadableDocument
from tests.media.pdf_fixtures import aes_encrypted_pdf, flate_bomb_pdf, image_only_pdf

LIMITS = ExtractLimits(max_pdf_pages=300, max_chars=400_000, max_extract_s=30.0, max_memory_bytes=2 << 30)


def read(tmp_path, data: bytes, media_type: str = "text/plain") -> DocumentText:
    path = tmp_path / "upload"
    path.write_bytes(data)
    if documents.is_pdf(media_type):
        return documents.read_pdf(path, LIMITS)
    return documents.read_text(path, media_type, LIMITS)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_text_with_a_utf16_or_utf32_bom_is_decoded(tmp_path, encoding):
    data = "\ufeffGrüße aus Köln\n".encode(encoding)  # the BOM, then the text, in that byte order
    assert read(tmp_path, data, "application/octet-stream").text == "Grüße aus Köln\n"


def test_binary_without_a_bom_and_bad_utf16_are_still_refused(tmp_path):
    with pytest.raises(UnreadableDocument, match="binary"):
        read(tmp_path, "Hello".encode("utf-16-be"))  # no BOM: NUL bytes
    with pytest.raises(UnreadableDocument, match="UTF-16"):
        read(tmp_path, b"\xff\xfe" + b"\x00\xd8" * 3)  # lone surrogates
    with pytest.raises(UnreadableDocument, match="NUL"):
        read(tmp_path, "\ufeffa\0b".encode("utf-16"))
    with pytest.raises(UnreadableDocument, match="cannot be read as text"):
        read(tmp_path, b"\0\1\2\3" * 10, "application/octet-stream")


def test_a_decompression_bomb_is_refused_at_pypdfs_limit(tmp_path):
    with pytest.raises(UnreadableDocument, match="reached a safety limit"):
        read(tmp_path, flate_bomb_pdf(), "application/pdf")


def test_an_aes_encrypted_pdf_is_refused_as_encrypted(tmp_path):
    with pytest.raises(UnreadableDocument, match="the PDF is encrypted"):
        read(tmp_path, aes_encrypted_pdf(), "application/pdf")


def test_a_pdf_without_any_text_is_refused_saying_ocr_is_not_done(tmp_path):
    with pytest.raises(UnreadableDocument, match=r"no text could be extracted from its 2 pages .*OCR"):
        read(tmp_path, image_only_pdf(2), "application/pdf")


def test_a_refusal_is_remembered_until_a_reader_limit_changes(tmp_path):
    cache = tmp_path / "file.txt"
    documents.write_cache(cache, LIMITS, UnreadableDocument("the PDF took too long to read"))
    with pytest.raises(UnreadableDocument, match="took too long"):
        documents.read_cache(cache, LIMITS)
    longer = dataclasses.replace(LIMITS, max_extract_s=60.0)
    assert documents.read_cache(cache, longer) is None  # read again under the new limit
    assert documents.read_cache(cache, dataclasses.replace(LIMITS, max_memory_bytes=4 << 30)) is None
    doc = DocumentText("text", 1, 1)
    documents.write_cache(cache, LIMITS, doc)
    assert documents.read_cache(cache, longer) == doc  # a text does not depend on the deadline


def test_concurrent_cache_writers_each_rename_their_own_temp_file(tmp_path, monkeypatch):
    """Writer A is interrupted between writing its temp file and renaming it; writer B writes and
    renames in between (as two requests for one uncached file do). A fixed temp name made A's
    rename fail."""
    cache = tmp_path / "file.txt"
    real_replace = os.replace
    first, second = DocumentText("first", None, None), DocumentText("second", None, None)

    def interleaved(src, dst):
        monkeypatch.setattr(os, "replace", real_replace)
        documents.write_cache(cache, LIMITS, second)  # B, while A's temp file waits
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interleaved)
    documents.write_cache(cache, LIMITS, first)
    assert documents.read_cache(cache, LIMITS) == first  # the last rename wins whole
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]  # no temp file left behind
