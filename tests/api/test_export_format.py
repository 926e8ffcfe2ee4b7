"""The export's Markdown (api/export_format.py): a code fence an answer left open is closed before
the next message, attachment names are literal text, roles and models name each speaker."""

from __future__ import annotations

from api.export_format import markdown_document, safe_stem


def document(*messages: dict, title: str | None = "T") -> str:
    return markdown_document({"title": title, "messages": list(messages)})


def test_a_fence_left_open_is_closed_so_the_next_message_is_not_code():
    cut = {"role": "assistant", "model": "m", "content": "Here:\n````python\nprint(1)\n```\nstill code"}
    text = document(cut, {"role": "user", "content": "thanks"})
    assert "still code\n````\n\n**User**\n\nthanks\n" in text
    closed = {"role": "assistant", "model": "m", "content": "~~~\nx\n~~~"}
    assert document(closed).endswith("**Assistant (m)**\n\n~~~\nx\n~~~\n")


def test_attachment_names_are_code_spans_and_speakers_name_their_role_and_model():
    message = {"role": "user", "content": "", "attachments": ["a`b.txt", "*bold*.md"]}
    text = document(message, {"role": "system", "content": "Be brief."}, title=None)
    assert text == "# Untitled\n\n**User**\n\nAttachments:\n\n- ``a`b.txt``\n- `*bold*.md`\n\n**System**\n\nBe brief.\n"


def test_safe_stem_drops_invisible_characters_and_keeps_utf8_within_the_byte_bound():
    assert safe_stem("a\x00b\tc\u200bd") == "a b c d"
    long = safe_stem("\u65e5" * 100)
    assert len(long.encode()) <= 150 and set(long) == {"\u65e5"}
    assert safe_stem("NUL") == "NUL_" and safe_stem(" . ") == ""
