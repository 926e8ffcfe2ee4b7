"""Share links in the web chat: the header's Share button makes a link to a snapshot of the open
chat (a dialog with Copy, Update and Revoke, keyboard-friendly), and the link opened in a fresh
browser (no key, nothing stored) shows the conversation read-only, its Markdown rendered through
the chat's sanitiser: hostile answers stay inert there too. Later turns show only once updated.
A reader past its reads a minute is told when to reload; with sharing off there is no Share button."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import (
    conversation_id,
    open_page,
    start_ui_server,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)
from tests.ui.test_xss import CANARY, HOSTILE, assert_rendered_inert

pytestmark = pytest.mark.slow


def share_link(page) -> str:
    """Clicks Share and returns the link its dialog shows (the dialog left open)."""
    page.get_by_role("button", name="Share", exact=True).click()
    dialog = page.get_by_role("dialog", name="Share this conversation")
    expect(dialog).to_be_visible()
    link = dialog.get_by_label("Link")
    wait_until(lambda: link.input_value())
    return link.input_value()


def open_shared(browser, ui_server, link: str):
    """The link in a fresh browser context: no API key, no local storage, no cookies."""
    assert link.startswith(ui_server.base_url + "/share/")
    return open_page(browser, ui_server.base_url, path=link[len(ui_server.base_url) :])


def test_a_shared_chat_opens_read_only_in_a_fresh_browser_and_stays_a_snapshot(ui, browser, ui_server):
    page = ui.page
    expect(page.get_by_role("button", name="Share", exact=True)).to_be_hidden()  # a new chat: nothing to share
    type_and_send(page, "Share me: **bold** and `code`")
    wait_for_answer_done(page)
    link = share_link(page)
    dialog = page.get_by_role("dialog", name="Share this conversation")
    copy = dialog.get_by_role("button", name="Copy link")
    expect(copy).to_be_focused()
    copy.click()
    assert page.evaluate("navigator.clipboard.readText()") == link
    expect(dialog.get_by_role("button", name="Update snapshot")).to_be_hidden()
    ui.screenshot("share-dialog-light")
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()
    expect(page.get_by_role("button", name="Share", exact=True)).to_be_focused()

    shared = open_shared(browser, ui_server, link)
    try:
        view = shared.page
        expect(view.locator("#shared-title")).to_have_text("Share me: **bold** and `code`")
        expect(view.locator("#shared-note")).to_contain_text("read-only snapshot")
        answer = view.locator("article.msg-assistant .msg-body")
        expect(answer.locator("strong")).to_have_text("bold")  # Markdown rendered
        expect(view.locator("article.msg-user .msg-body")).to_have_text("Share me: **bold** and `code`")
        assert view.locator("textarea, #composer, [data-action='edit'], [data-action='regenerate']").count() == 0
        assert not any("/v1/" in u and "/v1/shared/" not in u for u in shared.requests), shared.requests
        assert shared.console_errors == [] and shared.page_errors == [] and shared.foreign_requests() == []
        shared.screenshot("share-page-light")

        type_and_send(page, "A later message")
        wait_for_answer_done(page)
        view.reload()
        view.wait_for_selector("body.ready")
        expect(view.locator("article.msg")).to_have_count(2)  # the snapshot, not the chat as it is now

        assert share_link(page) == link  # the same link, not a new one
        page.get_by_role("button", name="Update snapshot").click()
        expect(dialog.get_by_role("button", name="Update snapshot")).to_be_hidden()
        expect(dialog.get_by_role("button", name="Copy link")).to_be_focused()  # not lost with the hidden button
        dialog.get_by_role("button", name="Done").click()
        expect(dialog).to_be_hidden()
        view.reload()
        view.wait_for_selector("body.ready")
        expect(view.locator("article.msg")).to_have_count(4)

        # A second link of the chat (another tab's, or an API client's): Revoke stops both.
        cid = conversation_id(page)
        other = urllib.request.Request(f"{ui_server.base_url}/v1/conversations/{cid}/shares", data=b"{}", method="POST")
        other.add_header("Content-Type", "application/json")
        other_path = json.loads(urllib.request.urlopen(other, timeout=10).read())["path"]
        share_link(page)
        page.get_by_role("button", name="Revoke link").click()
        confirm = page.locator("#confirm-dialog")  # revoking is asked first: cancelling keeps the link
        expect(confirm).to_contain_text("Revoke this chat's share link?")
        confirm.get_by_role("button", name="Cancel").click()
        expect(dialog).to_be_visible()
        assert ui_server.get_json(f"/v1/shared/{other_path.rsplit('/', 1)[1]}")[0] == 200
        page.get_by_role("button", name="Revoke link").click()
        confirm.get_by_role("button", name="Revoke").click()
        expect(dialog).to_be_hidden()
        expect(page.locator("#banner-text")).to_contain_text("revoked")
        view.reload()
        view.wait_for_selector("body.ready")
        expect(view.locator("#shared-title")).to_have_text("No shared conversation")
        expect(view.locator("article.msg")).to_have_count(0)
        token = other_path.rsplit("/", 1)[1]
        assert ui_server.get_json(f"/v1/shared/{token}")[0] == 404
    finally:
        shared.close()
    assert conversation_id(page)  # the chat itself is untouched
    assert ui.page_errors == [] and ui.console_errors == []


def test_a_hostile_answer_renders_inert_on_the_shared_page(ui, browser, ui_server):
    page = ui.page
    type_and_send(page, HOSTILE)
    wait_for_answer_done(page)
    link = share_link(page)
    page.keyboard.press("Escape")

    shared = open_shared(browser, ui_server, link)
    try:
        view = shared.page
        body = view.locator("article.msg-assistant .msg-body")
        wait_until(lambda: "Hostile corpus" in body.inner_text())
        assert_rendered_inert(body)
        text = body.inner_text()
        assert "<script>" in text and "onerror" in text  # raw HTML shown as text
        assert body.locator(".blocked-image").count() == 1  # the tracking pixel is not loaded
        body.get_by_text("click me").click()
        body.get_by_text("raw bold", exact=False).first.hover()
        view.wait_for_timeout(300)
        assert view.evaluate(f"typeof window.{CANARY}") == "undefined"
        assert shared.dialogs == [] and shared.console_errors == [] and shared.page_errors == []
        assert shared.foreign_requests() == []
        assert len(view.context.pages) == 1, "a link opened a new window"
    finally:
        shared.close()


def post_json(base_url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    return json.loads(urllib.request.urlopen(request, timeout=10).read())


def test_a_reader_past_its_reads_a_minute_is_told_when_to_reload(browser, tiny_model_dir, tmp_path):
    server = start_ui_server(tmp_path, tiny_model_dir, extra_config="\n[sharing]\nreads_per_minute = 2\n")
    try:
        cid = post_json(server.base_url, "/v1/conversations", {"items": [{"role": "user", "content": "Read me"}]})["id"]
        path = post_json(server.base_url, f"/v1/conversations/{cid}/shares", {})["path"]
        shared = open_page(browser, server.base_url, path=path)  # the page and its JSON: both reads
        try:
            view = shared.page
            expect(view.locator("#shared-title")).to_have_text("Read me")
            view.reload()  # a read refills in 30 s: the page and its JSON are refused
            view.wait_for_selector("body.ready")
            expect(view.locator("#shared-title")).to_have_text("No shared conversation")
            expect(view.locator("#shared-note")).to_contain_text(re.compile(r"Reload the page in \d+ seconds\."))
            expect(view.locator("article.msg")).to_have_count(0)
            assert shared.page_errors == []
        finally:
            shared.close()
    finally:
        server.stop()


def test_with_sharing_off_the_chat_offers_no_share_button(browser, tiny_model_dir, tmp_path):
    server = start_ui_server(tmp_path, tiny_model_dir, extra_config="\n[sharing]\nenabled = false\n")
    watched = open_page(browser, server.base_url)
    try:
        page = watched.page
        type_and_send(page, "Nothing to share here")
        wait_for_answer_done(page)
        assert conversation_id(page)  # a stored chat: the button would be offered were sharing on
        expect(page.get_by_role("button", name="Download", exact=True)).to_be_visible()  # shown with Share
        expect(page.get_by_role("button", name="Share", exact=True)).to_be_hidden()
        page.reload()
        page.wait_for_selector("body.ready")
        expect(page.get_by_role("button", name="Share", exact=True)).to_be_hidden()
        assert watched.page_errors == [] and watched.console_errors == []
    finally:
        watched.close()
        server.stop()
