"""TextMemory: extracted texts by file id within a bound on their characters, the least recently
used leaving first; a text kept under other limits is not served; a deleted file's text is forgotten."""

from __future__ import annotations

from media.documents import DocumentText, ExtractLimits
from media.text_memory import TextMemory

LIMITS = ExtractLimits(max_pdf_pages=300, max_chars=1000, max_extract_s=30.0, max_memory_bytes=1 << 30)


def doc(num_chars: int) -> DocumentText:
    return DocumentText("x" * num_chars, num_pages=None, num_pages_read=None)


def test_the_least_recently_used_text_leaves_when_a_new_one_would_pass_the_bound():
    memory = TextMemory(max_chars=100)
    memory.put("file-a", LIMITS, doc(40))
    memory.put("file-b", LIMITS, doc(40))
    assert memory.get("file-a", LIMITS) is not None  # a is now the most recently used
    memory.put("file-c", LIMITS, doc(40))
    assert memory.get("file-b", LIMITS) is None
    assert memory.get("file-a", LIMITS) is not None and memory.get("file-c", LIMITS) is not None
    assert memory.num_chars == 80 and len(memory) == 2


def test_a_text_longer_than_the_whole_memory_is_not_kept_and_evicts_nothing():
    memory = TextMemory(max_chars=100)
    memory.put("file-a", LIMITS, doc(60))
    memory.put("file-big", LIMITS, doc(101))
    assert memory.get("file-big", LIMITS) is None and memory.get("file-a", LIMITS) is not None
    nothing = TextMemory(max_chars=0)  # files.max_text_memory_chars = 0: nothing kept
    nothing.put("file-a", LIMITS, doc(1))
    assert nothing.get("file-a", LIMITS) is None


def test_a_text_kept_under_other_limits_is_not_served_and_forget_frees_its_characters():
    memory = TextMemory(max_chars=100)
    memory.put("file-a", LIMITS, doc(30))
    fewer_pages = ExtractLimits(10, LIMITS.max_chars, LIMITS.max_extract_s, LIMITS.max_memory_bytes)
    assert memory.get("file-a", fewer_pages) is None
    memory.put("file-a", fewer_pages, doc(20))  # replaces the entry: counted once
    assert memory.num_chars == 20 and memory.get("file-a", fewer_pages) is not None
    memory.forget("file-a")
    memory.forget("file-a")  # forgetting twice is harmless
    assert memory.num_chars == 0 and len(memory) == 0
