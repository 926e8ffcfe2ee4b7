"""API keys in the browser: local mode asks for none; a key entered in the UI is kept in
local storage, sent as a Bearer token and selects its organisation (tier, models, budget).
The model picker offers only the models that chat."""

from __future__ import annotations

import json

import pytest

from tests.ui.helpers import (
    last_answer,
    model_options,
    open_page,
    sidebar_titles,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)

pytestmark = pytest.mark.slow


def test_a_key_entered_in_the_browser_is_kept_and_selects_its_organisation(browser, ui_server):
    secret = ui_server.create_key("acme-ui", "free", budget_usd="0")
    watched = open_page(browser, ui_server.base_url)
    try:
        page = watched.page
        assert not page.locator("#key-dialog").is_visible(), "local mode must not ask for a key"
        assert model_options(page) == ["echo-large", "echo-small"]

        page.get_by_role("button", name="Use an API key…").click()
        page.get_by_label("Key", exact=True).fill(secret)
        page.get_by_role("button", name="Save").click()
        wait_until(lambda: model_options(page) == ["echo-small"])
        assert sidebar_titles(page) == []  # acme-ui's conversations, not the local org's
        usage = page.locator("#usage-summary")
        wait_until(lambda: usage.inner_text().endswith(" \u00b7 $0 of $0 budget"))  # acme-ui's budget, reached
        assert "usage-near-limit" in (usage.get_attribute("class") or "")
        assert page.evaluate("localStorage.getItem('chat.apiKey')") == secret

        type_and_send(page, "hello from acme")
        banner = page.get_by_role("alert")
        banner.wait_for(state="visible")
        assert "Over budget" in banner.inner_text()
        assert page.get_by_role("button", name="Retry").is_hidden()
        watched.screenshot("over-budget-light")

        page.reload()
        page.wait_for_selector("body.ready")
        assert model_options(page) == ["echo-small"]
        page.get_by_role("button", name="Change API key…").click()
        page.get_by_role("button", name="Forget key").click()
        wait_until(lambda: model_options(page) == ["echo-large", "echo-small"])
        assert page.evaluate("localStorage.getItem('chat.apiKey')") is None
        wait_until(lambda: "budget" not in page.locator("#usage-summary").inner_text())  # local: no budget
        assert watched.dialogs == [] and watched.page_errors == []
    finally:
        watched.close()


def test_a_base_model_is_not_offered_in_the_picker(browser, ui_server):
    """/v1/models marks a model without a chat template `chat: false` (it would answer every chat
    with 400 model_not_chat); listed first and remembered as the user's choice, it is still skipped."""
    watched = open_page(browser, ui_server.base_url)
    try:
        page = watched.page
        page.evaluate("localStorage.setItem('chat.model', 'echo-base')")
        models = {
            "object": "list",
            "data": [
                {"id": "echo-base", "object": "model", "max_model_len": 16384, "chat": False},
                {"id": "echo-large", "object": "model", "max_model_len": 16384},
                {"id": "echo-small", "object": "model", "max_model_len": 16384, "chat": True},
            ],
        }
        page.route(
            "**/v1/models", lambda route: route.fulfill(content_type="application/json", body=json.dumps(models))
        )
        page.reload()
        page.wait_for_selector("body.ready")
        assert model_options(page) == ["echo-large", "echo-small"]
        assert page.locator("#model-select").input_value() == "echo-large"

        type_and_send(page, "a chat, not a completion")
        wait_for_answer_done(page)
        assert last_answer(page).locator(".msg-meta").inner_text().startswith("echo-large \u00b7 ")
        assert page.get_by_role("alert").is_hidden()
        assert watched.dialogs == [] and watched.page_errors == []
    finally:
        watched.close()
