"""Searching conversations in the sidebar, in the real browser: typing finds chats by what was said
in them (one search once typing pauses, not one a key), each hit shows its matching text as text
(never HTML), a hit opens its chat at the message that matched, and Escape or clearing the box
brings the list back; all by keyboard."""

from __future__ import annotations

import json
import urllib.request
import uuid

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import conversation_id, sidebar_titles, type_and_send, wait_for_answer_done, wait_until

pytestmark = pytest.mark.slow

CANARY = "__search_xss"


def create_on_server(server, title: str, texts: list[str]) -> str:
    """A stored conversation (the keyless local organisation, as the page's), its messages
    alternating user and assistant; returns its id."""
    items = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
    request = urllib.request.Request(
        f"{server.base_url}/v1/conversations",
        data=json.dumps({"title": title, "items": items}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())["id"]


def searches_sent(ui) -> list[str]:
    return [u for u in ui.requests if "/v1/conversations?" in u and "q=" in u]


def test_typing_finds_chats_by_their_text_and_a_hit_opens_at_the_matching_message(ui, ui_server):
    page = ui.page
    word = f"okapi{uuid.uuid4().hex[:8]}"  # the session's server holds other tests' chats too
    type_and_send(page, f"Where do {word} herds live?")  # the fake model answers with the same text
    wait_for_answer_done(page)
    typed_id = conversation_id(page)
    filler = [f"filler message {i} " + "lorem ipsum dolor " * 30 for i in range(8)]
    deep_id = create_on_server(ui_server, "A long chat", [*filler, f"the {word} again, deep down", *filler])
    hostile_id = create_on_server(
        ui_server, "<b>Hostile</b> title", [f'<img src=x onerror="window.{CANARY}=1"><b>bold</b> {word}', "ok"]
    )
    page.get_by_role("button", name="New chat").click()
    listed = sidebar_titles(page)

    box = page.get_by_role("searchbox", name="Search conversations")
    box.focus()
    box.press_sequentially(word, delay=20)  # faster than the 250 ms pause
    hits = page.locator("#conversation-list .conv-hit")
    expect(hits).to_have_count(3)
    assert [hits.nth(i).get_attribute("data-id") for i in range(3)] == [hostile_id, deep_id, typed_id]  # newest first
    page.wait_for_timeout(400)
    assert 1 <= len(searches_sent(ui)) < len(word) // 2, searches_sent(ui)  # once typing paused, not per key

    hostile = hits.nth(0)
    expect(hostile.locator(".conv-snippet")).to_have_text(f'<img src=x onerror="window.{CANARY}=1"><b>bold</b> {word}')
    expect(hostile.locator(".conv-hit-title")).to_have_text("<b>Hostile</b> title")
    assert hostile.locator("img, b").count() == 0 and page.evaluate(f"window.{CANARY}") is None
    expect(hits.nth(2).locator(".conv-snippet")).to_contain_text(f"Where do {word} herds live?")
    ui.screenshot("search-hits-light")

    page.keyboard.press("Tab")  # from the box to the first hit, then on to the long chat's
    page.keyboard.press("Tab")
    assert hits.nth(1).locator(".conv-open").evaluate("(e) => e === document.activeElement")
    page.keyboard.press("Enter")
    wait_until(lambda: conversation_id(page) == deep_id)
    matched = page.locator('#messages article[data-index="8"]')
    expect(matched).to_contain_text(f"the {word} again, deep down")
    expect(matched).to_be_in_viewport()  # shown where it matched, not at the chat's end
    expect(page.locator('#messages article[data-index="16"]')).not_to_be_in_viewport()
    expect(hits).to_have_count(3)  # the hits stay for the next one

    box.focus()
    page.keyboard.press("Escape")
    expect(box).to_have_value("")
    expect(hits).to_have_count(0)
    assert sidebar_titles(page) == listed

    box.fill("no chat holds this text")
    expect(page.locator("#conversation-empty")).to_have_text("No conversations match.")
    box.fill("")  # cleared (the box's own x does this too): the list at once
    expect(page.locator("#conversation-empty")).to_be_hidden()
    assert sidebar_titles(page) == listed
    assert not ui.page_errors and not ui.console_errors
