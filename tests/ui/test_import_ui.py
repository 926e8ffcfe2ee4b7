"""Importing in the web chat: "Import conversations" in the sidebar's foot picks a JSON file an
export saved, posts it through the API with the UI's own authentication, says so and shows the
new conversations in the list; a file the server refuses shows its error and adds nothing."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import sidebar_titles, type_and_send, wait_for_answer_done

pytestmark = pytest.mark.slow


def pick_file(page, path: Path) -> None:
    with page.expect_file_chooser() as chooser:
        page.get_by_role("button", name="Import conversations").click()
    chooser.value.set_files(str(path))


def test_an_exported_file_imports_back_and_its_conversations_are_listed(ui, tmp_path):
    page = ui.page
    text = f"Round trip {uuid.uuid4().hex[:8]}"  # the session's server holds other tests' chats too
    type_and_send(page, text)
    wait_for_answer_done(page)
    with page.expect_download() as info:
        page.get_by_role("button", name="Export all conversations").click()
    exported = json.loads(Path(info.value.path()).read_text(encoding="utf-8"))
    one = next(c for c in exported["data"] if c["title"] == text)
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"object": "list", "data": [one]}), encoding="utf-8")
    assert sidebar_titles(page).count(text) == 1

    pick_file(page, path)
    expect(page.locator("#banner-text")).to_have_text("Imported 1 conversation from one.json.")
    expect(page.locator("#conversation-list .conv-open", has_text=text)).to_have_count(2)
    ids = [li.get_attribute("data-id") for li in page.locator("#conversation-list li", has_text=text).all()]
    (copy_id,) = set(ids) - {one["id"]}  # a new id: the file's own was not reused
    page.locator(f'#conversation-list li[data-id="{copy_id}"] .conv-open').click()
    expect(page.locator("article.msg-user .msg-body")).to_have_text([text])
    expect(page.locator("article.msg-assistant .msg-body")).to_have_text([text])
    assert not ui.page_errors and not ui.console_errors


def test_a_file_the_server_refuses_shows_its_error_and_adds_nothing(ui, tmp_path):
    page = ui.page
    path = tmp_path / "bad.json"
    title = f"Never stored {uuid.uuid4().hex[:8]}"
    bad = {"object": "list", "data": [{"title": title, "messages": [{"role": "narrator", "content": "x"}]}]}
    path.write_text(json.dumps(bad), encoding="utf-8")
    pick_file(page, path)
    banner = page.locator("#banner-text")
    expect(banner).to_contain_text("bad.json is not a conversation export this chat can read (")  # first, in words
    expect(banner).to_contain_text("data[0].messages[0].role")
    expect(banner).to_contain_text("'narrator'")
    expect(page.get_by_role("button", name="Import conversations")).not_to_have_attribute("aria-busy", "true")
    assert title not in sidebar_titles(page)

    (tmp_path / "notes.json").write_text("these are not JSON", encoding="utf-8")
    pick_file(page, tmp_path / "notes.json")
    expect(banner).to_contain_text("notes.json is not a conversation export this chat can read (")
    expect(banner).to_contain_text("not valid JSON")
