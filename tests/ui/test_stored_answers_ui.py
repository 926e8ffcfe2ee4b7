"""A stored conversation reads after a reload as it did live: a stopped answer keeps its
"Stopped." mark, the details line keeps its tokens, cost and notes, and opening a conversation
puts the model picker on the model that conversation used, so the next turn does not silently
switch models."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import (
    conversation_id,
    last_answer,
    open_page,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)

pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(f"word{i}" for i in range(400))  # several hundred tokens: ~20 s at 0.05 s each


def stored_answer(server, cid: str) -> dict | None:
    status, stored = server.get_json(f"/v1/conversations/{cid}")
    answers = [m for m in stored.get("messages", []) if m["role"] == "assistant"] if status == 200 else []
    return answers[-1] if answers else None


def reload(page) -> None:
    page.reload()
    page.wait_for_selector("body.ready")


def note_of(page) -> str:
    notes = last_answer(page).locator(".msg-note")
    return notes.inner_text() if notes.count() else ""


def start_long_answer(page) -> None:
    type_and_send(page, LONG_TEXT)
    wait_until(lambda: len(last_answer(page).locator(".msg-body").inner_text()) > 20)


def pick_model(page, model: str) -> None:
    page.locator("#model-select").select_option(model)


def test_a_stopped_answer_keeps_its_stopped_mark_after_a_reload(ui, ui_server):
    page = ui.page
    start_long_answer(page)
    page.get_by_label("Message", exact=True).press("Escape")
    wait_for_answer_done(page)
    assert note_of(page) == "Stopped."
    cid = conversation_id(page)
    assert stored_answer(ui_server, cid)["finish_reason"] == "abort"

    reload(page)
    assert conversation_id(page) == cid
    assert 0 < len(last_answer(page).locator(".msg-body").inner_text()) < len(LONG_TEXT)
    assert note_of(page) == "Stopped."
    assert not ui.console_errors and not ui.page_errors


def test_an_answer_cut_by_a_reload_mid_stream_shows_as_stopped(ui, ui_server):
    page = ui.page
    start_long_answer(page)
    cid = conversation_id(page)
    reload(page)  # the stream's connection goes with the page: the server stores what it had
    answer = wait_until(lambda: stored_answer(ui_server, cid))
    assert answer["finish_reason"] == "abort"
    reload(page)  # the first reload may have read the conversation before the answer was stored
    assert note_of(page) == "Stopped."
    assert not ui.page_errors


def test_the_details_line_after_a_reload_matches_the_live_one(ui, ui_server):
    page = ui.page
    type_and_send(page, "How many tokens was this?")
    wait_for_answer_done(page)
    meta = last_answer(page).locator(".msg-meta")
    live = meta.inner_text()
    answer = stored_answer(ui_server, conversation_id(page))
    usage = answer["usage"]  # as billed: the stored answer's ledger row
    model, prompt, completion, cost = live.split(" \u00b7 ")
    assert (model, prompt, completion) == (answer["model"], f"{usage['prompt_tokens']} in", f"{answer['tokens']} out")
    assert cost.startswith("$") and usage["cost_usd"] > 0

    reload(page)
    assert meta.inner_text() == live
    assert not ui.console_errors and not ui.page_errors


@pytest.mark.parametrize(("reason", "label"), [(None, "instead of echo-huge"), ("busy", "echo-huge was busy")])
def test_a_reloaded_answer_keeps_its_cached_tokens_and_fallback_notes(ui, ui_server, reason, label):
    """The fake backend caches nothing, never falls back and drops no history: the stored
    answer is given all three, as the conversation API reports them, to check the line and the
    notes read as they do live."""
    page = ui.page
    type_and_send(page, "Served by another model")
    wait_for_answer_done(page)
    cid = conversation_id(page)
    answer = stored_answer(ui_server, cid)

    def with_notes(route):
        conversation = route.fetch().json()
        stored = conversation["messages"][-1]
        stored["fallback_from"] = "echo-huge"
        if reason is not None:
            stored["fallback_reason"] = reason
        stored["history_messages_dropped"] = 2
        stored["usage"]["prompt_tokens_details"]["cached_tokens"] = 3
        route.fulfill(content_type="application/json", body=json.dumps(conversation))

    page.route(f"**/v1/conversations/{cid}", with_notes)
    reload(page)
    parts = last_answer(page).locator(".msg-meta").inner_text().split(" \u00b7 ")
    assert parts[:4] == [
        answer["model"],
        f"fallback: {label}",
        f"{answer['usage']['prompt_tokens']} in (3 cached)",
        f"{answer['tokens']} out",
    ]
    assert "without the first 2 messages of the chat" in last_answer(page).inner_text()
    assert not ui.console_errors and not ui.page_errors


def test_opening_a_conversation_selects_the_model_it_used(ui, ui_server):
    page = ui.page
    picker = page.locator("#model-select")
    pick_model(page, "echo-small")
    type_and_send(page, "small talk")
    wait_for_answer_done(page)
    small_cid = conversation_id(page)
    page.get_by_role("button", name="New chat").click()
    pick_model(page, "echo-large")
    type_and_send(page, "large talk")
    wait_for_answer_done(page)
    large_cid = conversation_id(page)

    page.locator(f'#conversation-list li[data-id="{small_cid}"] .conv-open').click()
    wait_until(lambda: conversation_id(page) == small_cid)
    expect(picker).to_have_value("echo-small")
    type_and_send(page, "more small talk")
    wait_for_answer_done(page)
    assert last_answer(page).locator(".msg-meta").inner_text().startswith("echo-small \u00b7 ")
    assert stored_answer(ui_server, small_cid)["model"] == "echo-small"

    page.locator(f'#conversation-list li[data-id="{large_cid}"] .conv-open').click()
    wait_until(lambda: conversation_id(page) == large_cid)
    expect(picker).to_have_value("echo-large")
    pick_model(page, "echo-small")  # chosen in the picker: kept as the choice for new chats
    page.locator(f'#conversation-list li[data-id="{large_cid}"] .conv-open').click()
    expect(picker).to_have_value("echo-large")
    page.get_by_role("button", name="New chat").click()
    expect(picker).to_have_value("echo-small")

    page.goto(f"{ui_server.base_url}/#{large_cid}")
    reload(page)
    expect(picker).to_have_value("echo-large")
    assert not ui.console_errors and not ui.page_errors


def test_a_conversation_whose_model_is_no_longer_offered_keeps_the_current_one(browser, ui_server):
    first = open_page(browser, ui_server.base_url)
    try:
        pick_model(first.page, "echo-large")
        type_and_send(first.page, "written by the large model")
        wait_for_answer_done(first.page)
        cid = conversation_id(first.page)
    finally:
        first.close()

    watched = open_page(browser, ui_server.base_url)
    try:
        page = watched.page
        small_only = {"object": "list", "data": [{"id": "echo-small", "object": "model", "max_model_len": 16384}]}
        page.route(
            "**/v1/models", lambda route: route.fulfill(content_type="application/json", body=json.dumps(small_only))
        )
        page.goto(f"{ui_server.base_url}/#{cid}")
        reload(page)
        assert conversation_id(page) == cid
        assert last_answer(page).locator(".msg-body").inner_text().strip() == "written by the large model"
        expect(page.locator("#model-select")).to_have_value("echo-small")
        assert page.get_by_role("alert").is_hidden()
        assert not watched.dialogs and not watched.page_errors
    finally:
        watched.close()
