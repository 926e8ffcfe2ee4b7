"""A reasoning model in the browser: its thinking streams into a folded "Reasoning" block
above the answer, and the answer itself holds only the text after </think>."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.api.helpers import THINKING_TEMPLATE
from tests.ui.helpers import last_answer, open_page, start_ui_server, type_and_send, wait_for_answer_done

pytestmark = pytest.mark.slow


def serve_reasoner(model_dir, tmp_path_factory, name: str):
    """The UI server over `model_dir` with a reasoning chat template."""
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    server = start_ui_server(tmp_path_factory.mktemp(f"ui-{name}"), model_dir)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def thinking_server(tiny_model_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    yield from serve_reasoner(model_dir, tmp_path_factory, "thinking")


def test_reasoning_streams_into_a_folded_block_above_the_answer(browser, thinking_server):
    watched = open_page(browser, thinking_server.base_url)
    try:
        page = watched.page
        # The echo backend answers with the user's text: here, a reasoning model's output.
        type_and_send(page, "<think>Weigh both options first.</think>Take the second one.")
        wait_for_answer_done(page)
        answer = last_answer(page)
        details = answer.locator("details.msg-reasoning")
        assert details.count() == 1
        assert details.locator(".msg-reasoning-text").text_content() == "Weigh both options first."
        assert answer.locator(".msg-body").inner_text().strip() == "Take the second one."
        assert details.evaluate("d => d.open") is False, "finished reasoning is folded"
        assert " thinking)" in answer.locator(".msg-meta").inner_text()  # usage's reasoning_tokens
        assert not watched.console_errors and not watched.page_errors
    finally:
        watched.close()


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory):
    # <think> and </think> single tokens: the server can cap this model's thinking.
    from testing.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("capped") / "model", thinking_tags=True)
    yield from serve_reasoner(model_dir, tmp_path_factory, "capped")


def chat_bodies(page) -> list[dict]:
    bodies: list[dict] = []
    page.on(
        "request",
        lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions") else None,
    )
    return bodies


def test_a_reasoning_model_offers_thinking_choices_and_each_reaches_the_request(browser, capped_server):
    watched = open_page(browser, capped_server.base_url)
    try:
        page = watched.page
        bodies = chat_bodies(page)
        picker = page.get_by_label("Thinking", exact=True)
        assert picker.is_visible() and picker.input_value() == ""
        assert page.locator('#thinking-select option[value="brief"]').is_enabled()
        for choice, expected in [("off", {"reasoning_effort": "none"}), ("brief", {"thinking_token_budget": 256})]:
            picker.select_option(choice)
            type_and_send(page, f"<think>Think about {choice}.</think>Done.")
            wait_for_answer_done(page)
            assert {k: bodies[-1].get(k) for k in expected} == expected
        type_and_send(page, "Nothing chosen.")  # the choice stays
        wait_for_answer_done(page)
        assert bodies[-1].get("thinking_token_budget") == 256
        page.reload()
        page.wait_for_selector("body.ready")
        assert page.get_by_label("Thinking", exact=True).input_value() == "brief"  # remembered
        assert not watched.console_errors and not watched.page_errors
    finally:
        watched.close()


def test_thinking_briefly_is_offered_only_where_the_thinking_can_be_capped(browser, thinking_server):
    # This model's tags are not single tokens: it can be told not to think, not to think briefly.
    watched = open_page(browser, thinking_server.base_url)
    try:
        page = watched.page
        assert page.get_by_label("Thinking", exact=True).is_visible()
        assert page.locator('#thinking-select option[value="brief"]').is_disabled()
    finally:
        watched.close()


def test_a_model_that_does_not_think_offers_no_thinking_choice(ui):
    assert ui.page.locator("#thinking-picker").is_hidden()
    with ui.page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as request:
        type_and_send(ui.page, "hello")
    body = json.loads(request.value.post_data)
    wait_for_answer_done(ui.page)
    assert "reasoning_effort" not in body and "thinking_token_budget" not in body
