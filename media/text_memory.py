"""Extracted file texts kept in memory, by file id, the least recently used leaving first.

Owns the bound on that memory (`max_chars` of text in all) and forgetting a deleted file. A
stored conversation renders its files on every turn: from here, without reading the cache file
beside the upload (media/documents.py) again. It never extracts, and never decides whether a file
still exists: callers look the file up first (a file id is never reused).
"""

from __future__ import annotations

from collections import OrderedDict

from media.documents import DocumentText, ExtractLimits

_Key = tuple[int, int]  # (max_pdf_pages, max_chars): the limits the text was extracted under


class TextMemory:
    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.num_chars = 0
        self._texts: OrderedDict[str, tuple[_Key, DocumentText]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._texts)

    def get(self, file_id: str, limits: ExtractLimits) -> DocumentText | None:
        """The text, when kept under these limits (then it is the most recently used)."""
        entry = self._texts.get(file_id)
        if entry is None or entry[0] != _key(limits):
            return None
        self._texts.move_to_end(file_id)
        return entry[1]

    def put(self, file_id: str, limits: ExtractLimits, doc: DocumentText) -> None:
        """Keep the text, dropping the least recently used until it fits; one longer than the
        whole memory is not kept."""
        self.forget(file_id)
        if len(doc.text) > self.max_chars:
            return
        while self.num_chars + len(doc.text) > self.max_chars:
            _, (_, old) = self._texts.popitem(last=False)
            self.num_chars -= len(old.text)
        self._texts[file_id] = (_key(limits), doc)
        self.num_chars += len(doc.text)

    def forget(self, file_id: str) -> None:
        entry = self._texts.pop(file_id, None)
        if entry is not None:
            self.num_chars -= len(entry[1].text)


def _key(limits: ExtractLimits) -> _Key:
    return limits.max_pdf_pages, limits.max_chars
