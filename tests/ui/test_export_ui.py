"""Downloads in the web chat: the header's Download menu saves the open conversation as Markdown
(named after its title, through the API with the UI's own authentication), works from the
keyboard, is not offered for a new chat; "Export all conversations" saves every one as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import conversation_id, type_and_send, wait_for_answer_done

pytestmark = pytest.mark.slow


def start_chat(page, text: str) -> str:
    type_and_send(page, text)
    wait_for_answer_done(page)
    return conversation_id(page)


def test_download_saves_the_open_conversation_as_markdown(ui):
    page = ui.page
    expect(page.locator("#download")).to_be_hidden()  # a new chat has nothing to download
    start_chat(page, "Export me: **bold** and `code`")
    toggle = page.get_by_role("button", name="Download", exact=True)
    expect(toggle).to_have_attribute("aria-expanded", "false")
    toggle.click()
    expect(toggle).to_have_attribute("aria-expanded", "true")
    with page.expect_download() as info:
        page.get_by_role("button", name="Markdown (.md)").click()
    download = info.value
    title = page.locator("#chat-title").inner_text()
    assert title == "Export me: **bold** and `code`"
    assert download.suggested_filename == "Export me_ _bold_ and _code.md"  # the title, made a safe name
    text = Path(download.path()).read_text(encoding="utf-8")
    assert text.startswith(f"# {title}\n\n**User**\n\nExport me: **bold** and `code`\n\n")
    assert "**Assistant (echo-large)**\n\nExport me: **bold** and `code`\n" in text
    expect(page.locator("#download-menu")).to_be_hidden()
    expect(toggle).to_be_focused()
    assert not ui.page_errors and not ui.console_errors


def test_the_download_menu_works_from_the_keyboard(ui):
    page = ui.page
    start_chat(page, "Keyboard export")
    toggle = page.locator("#download-toggle")
    toggle.focus()
    page.keyboard.press("Enter")
    markdown = page.get_by_role("button", name="Markdown (.md)")
    json_item = page.get_by_role("button", name="JSON (.json)")
    expect(markdown).to_be_focused()
    page.keyboard.press("ArrowDown")
    expect(json_item).to_be_focused()
    page.keyboard.press("Escape")
    expect(page.locator("#download-menu")).to_be_hidden()
    expect(toggle).to_be_focused()
    page.keyboard.press("Enter")
    page.keyboard.press("ArrowDown")
    with page.expect_download() as info:
        page.keyboard.press("Enter")
    exported = json.loads(Path(info.value.path()).read_text(encoding="utf-8"))
    assert exported["id"] == conversation_id(page)
    assert [m["content"] for m in exported["messages"]] == ["Keyboard export", "Keyboard export"]


def test_export_all_saves_every_conversation_as_one_json_file(ui):
    page = ui.page
    first = start_chat(page, "First of two")
    page.get_by_role("button", name="+ New chat").click()
    second = start_chat(page, "Second of two")
    with page.expect_download() as info:
        page.get_by_role("button", name="Export all conversations").click()
    assert info.value.suggested_filename == "conversations.json"
    exported = json.loads(Path(info.value.path()).read_text(encoding="utf-8"))
    ids = [c["id"] for c in exported["data"]]
    assert ids.index(second) < ids.index(first)  # newest first
    assert not ui.page_errors and not ui.console_errors
