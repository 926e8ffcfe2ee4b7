"""Keyboard focus and the edit box: focus returns to the message box after Stop, Regenerate
and an example prompt, to the Edit button after a cancelled edit; the phone's conversation drawer keeps Tab inside and
hands focus back on Escape; one edit box at a time, and a confirm before later turns go."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import (
    PHONE,
    last_answer,
    open_page,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)

pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(f"word{i}" for i in range(400))
FOCUSED_ID = "document.activeElement && document.activeElement.id"


def focus_is_in_message_box(page) -> bool:
    return page.evaluate(FOCUSED_ID) == "composer-input"


def two_turns(page) -> None:
    for text in ("first question", "second question"):
        type_and_send(page, text)
        wait_for_answer_done(page)


def test_stop_leaves_focus_in_the_message_box(ui):
    page = ui.page
    type_and_send(page, LONG_TEXT)
    wait_until(lambda: len(last_answer(page).locator(".msg-body").inner_text()) > 20)
    page.get_by_role("button", name="Stop").click()
    wait_for_answer_done(page)
    assert focus_is_in_message_box(page)


def test_regenerate_leaves_focus_in_the_message_box(ui):
    page = ui.page
    type_and_send(page, "once more")
    wait_for_answer_done(page)
    page.get_by_role("button", name="Regenerate the answer").click()
    wait_for_answer_done(page)
    wait_until(lambda: page.get_by_role("button", name="Regenerate the answer").count() == 1)
    assert focus_is_in_message_box(page)


def test_cancelling_an_edit_with_escape_puts_focus_back_on_its_edit_button(ui):
    page = ui.page
    type_and_send(page, "edit me later")
    wait_for_answer_done(page)
    page.get_by_role("button", name="Edit message 1").click()
    page.get_by_role("textbox", name="Edit message").press("Escape")
    expect(page.get_by_role("textbox", name="Edit message")).to_have_count(0)
    assert page.get_by_role("button", name="Edit message 1").evaluate("(e) => e === document.activeElement")


def test_an_example_prompt_leaves_focus_in_the_message_box(ui):
    page = ui.page

    def with_examples(route):
        models = route.fetch().json()
        for model in models["data"]:
            model["example_prompts"] = ["Say hello"]
        route.fulfill(content_type="application/json", body=json.dumps(models))

    page.route("**/v1/models", with_examples)
    page.reload()
    page.wait_for_selector("body.ready")
    page.get_by_role("button", name="Say hello").click()
    wait_for_answer_done(page)
    assert focus_is_in_message_box(page)


def test_the_phone_drawer_keeps_tab_inside_and_escape_returns_focus_to_its_button(browser, ui_server):
    phone = open_page(browser, ui_server.base_url, viewport=PHONE)
    try:
        page = phone.page
        page.get_by_role("button", name="Show conversations").click()
        page.locator("#sidebar").wait_for(state="visible")
        for _ in range(12):
            page.keyboard.press("Tab")
            assert page.evaluate("document.getElementById('sidebar').contains(document.activeElement)")
        page.keyboard.press("Shift+Tab")
        assert page.evaluate("document.getElementById('sidebar').contains(document.activeElement)")
        page.keyboard.press("Escape")
        page.locator("#sidebar").wait_for(state="hidden")
        assert page.evaluate(FOCUSED_ID) == "open-sidebar"
    finally:
        phone.close()


def test_only_one_edit_box_opens_and_regenerate_waits_for_it(ui):
    page = ui.page
    two_turns(page)
    page.get_by_role("button", name="Edit message 1").click()
    expect(page.get_by_role("textbox", name="Edit message")).to_have_count(1)
    assert page.get_by_role("button", name="Edit message 3").is_disabled()
    assert page.get_by_role("button", name="Regenerate the answer").is_disabled()


def test_editing_an_earlier_message_asks_before_removing_later_turns(ui, ui_server):
    page = ui.page
    two_turns(page)
    page.get_by_role("button", name="Edit message 1").click()
    editor = page.get_by_role("textbox", name="Edit message")
    editor.fill("a better first question")
    editor.press("Enter")
    dialog = page.locator("#confirm-dialog")
    expect(dialog).to_contain_text("2 later messages")
    dialog.get_by_role("button", name="Cancel").click()
    expect(editor).to_have_value("a better first question")  # the edit is still open, not lost
    assert page.locator("article.msg").count() == 4
    assert not ui.page_errors


def test_editing_the_first_message_retitles_a_chat_titled_from_it(ui, ui_server):
    page = ui.page
    type_and_send(page, "first draft of a question")
    wait_for_answer_done(page)
    cid = page.evaluate("window.location.hash.slice(1)")
    page.get_by_role("button", name="Edit message 1").click()
    editor = page.get_by_role("textbox", name="Edit message")
    editor.fill("final wording")
    editor.press("Enter")
    wait_for_answer_done(page)
    expect(page.locator("#chat-title")).to_have_text("final wording")
    assert ui_server.get_json(f"/v1/conversations/{cid}")[1]["title"] == "final wording"
    assert "final wording" in page.locator("#conversation-list").inner_text()
