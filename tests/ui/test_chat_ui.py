"""The chat UI in a real browser against the real server: streaming, persistence, stop,
rename, delete, edit-and-resend, regenerate, errors, and screenshots of the main states."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import (
    PHONE,
    conversation_id,
    last_answer,
    open_page,
    restart_ui_server,
    sidebar_titles,
    start_ui_server,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)

pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(f"word{i}" for i in range(400))  # several hundred tokens: ~20 s at 0.05 s each
MARKDOWN_SAMPLE = """# Release notes

Here is a **short** list with `inline code`:

1. Streams answers *token by token*
2. Renders [links](https://example.org/docs) that open in a new tab

```python
def add(a: int, b: int) -> int:
    return a + b  # highlighted
```

| model | tokens |
|-------|--------|
| echo-large | 42 |
"""


def test_answer_grows_while_streaming_then_persists_across_a_reload(ui, ui_server):
    page = ui.page
    message = "The quick brown fox jumps over the lazy dog and then keeps on running. " * 3
    type_and_send(page, message)
    answer_body = last_answer(page).locator(".msg-body")
    answer_body.locator("xpath=.").wait_for()
    lengths = []
    while page.locator("#stop").is_visible() and len(lengths) < 400:
        lengths.append(len(answer_body.inner_text()))
        time.sleep(0.1)
    wait_for_answer_done(page)
    partials = sorted({n for n in lengths if 0 < n < len(message.strip())})
    assert len(partials) >= 3, f"the answer did not grow in steps: {lengths}"
    assert lengths == sorted(lengths), "streamed text only ever grows"
    assert answer_body.inner_text().strip() == message.strip()
    assert "echo-large" in last_answer(page).locator(".msg-meta").inner_text()
    cid = conversation_id(page)
    assert cid.startswith("conv_")

    page.reload()
    page.wait_for_selector("body.ready")
    assert conversation_id(page) == cid
    assert page.locator("article.msg-user .msg-body").first.inner_text() == message
    assert last_answer(page).locator(".msg-body").inner_text().strip() == message.strip()
    assert any(t.startswith("The quick brown fox") for t in sidebar_titles(page))
    status, stored = ui_server.get_json(f"/v1/conversations/{cid}")
    assert status == 200 and [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    _, usage = ui_server.get_json("/v1/usage?group_by=model")
    num_requests = usage["total"]["num_requests"]
    expected = f"This month: {num_requests} request{'' if num_requests == 1 else 's'} \u00b7 "
    wait_until(lambda: page.locator("#usage-summary").inner_text().startswith(expected))
    assert not ui.dialogs and not ui.console_errors and not ui.page_errors


def test_stop_aborts_the_generation_on_the_server(ui, ui_server):
    page = ui.page
    type_and_send(page, LONG_TEXT)
    answer_body = last_answer(page).locator(".msg-body")
    wait_until(lambda: len(answer_body.inner_text()) > 20)
    ui.screenshot("streaming-light")
    page.get_by_role("button", name="Stop").click()
    wait_for_answer_done(page)
    assert "Stopped." in last_answer(page).inner_text()
    cid = conversation_id(page)

    rows = wait_until(lambda: ui_server.usage_rows(cid))
    assert [r["status"] for r in rows] == ["aborted"]
    assert 0 < rows[0]["completion_tokens"] < len(LONG_TEXT.split())
    _, stored = ui_server.get_json(f"/v1/conversations/{cid}")
    partial = stored["messages"][-1]
    assert partial["role"] == "assistant" and 0 < len(partial["content"]) < len(LONG_TEXT)
    assert not ui.console_errors and not ui.page_errors


def test_rename_and_delete_a_conversation(ui, ui_server):
    page = ui.page
    type_and_send(page, "Rename me please")
    wait_for_answer_done(page)
    cid = conversation_id(page)
    item = page.locator(f'#conversation-list li[data-id="{cid}"]')
    item.hover()
    item.get_by_role("button", name="Rename Rename me please").click()
    title_box = page.get_by_label("New title")
    title_box.fill("Trip to <b>Lisbon</b>")
    title_box.press("Enter")
    wait_until(lambda: ui_server.get_json(f"/v1/conversations/{cid}")[1].get("title") == "Trip to <b>Lisbon</b>")
    expect(page.locator("#chat-title")).to_have_text("Trip to <b>Lisbon</b>")  # waits for the UI to catch up
    page.reload()
    page.wait_for_selector("body.ready")
    assert "Trip to <b>Lisbon</b>" in sidebar_titles(page)

    item = page.locator(f'#conversation-list li[data-id="{cid}"]')
    item.hover()
    item.get_by_role("button", name="Delete Trip to <b>Lisbon</b>").click()
    dialog = page.locator("#confirm-dialog")
    assert dialog.is_visible() and "Lisbon" in dialog.inner_text()
    ui.screenshot("delete-confirm-light")
    dialog.get_by_role("button", name="Delete").click()
    wait_until(lambda: page.locator(f'#conversation-list li[data-id="{cid}"]').count() == 0)
    assert page.locator("#chat-title").inner_text() == "New chat"
    assert ui_server.get_json(f"/v1/conversations/{cid}")[0] == 404
    assert not ui.dialogs and not ui.console_errors


def test_edit_and_resend_then_regenerate_keep_the_server_in_step(ui, ui_server):
    page = ui.page
    type_and_send(page, "first question")
    wait_for_answer_done(page)
    type_and_send(page, "second question")
    wait_for_answer_done(page)
    cid = conversation_id(page)

    page.locator("article.msg-user").first.get_by_role("button", name="Edit message 1").click()
    editor = page.get_by_role("textbox", name="Edit message")
    editor.fill("edited question")
    editor.press("Enter")
    page.locator("#confirm-dialog").get_by_role("button", name="Remove and send").click()  # the later turn goes
    wait_for_answer_done(page)
    wait_until(lambda: last_answer(page).locator(".msg-body").inner_text().strip() == "edited question")
    _, stored = ui_server.get_json(f"/v1/conversations/{cid}")
    assert [m["content"] for m in stored["messages"]] == ["edited question", "edited question"]

    page.get_by_role("button", name="Regenerate the answer").click()
    wait_for_answer_done(page)
    wait_until(lambda: len(ui_server.usage_rows(cid)) == 4)
    _, stored = ui_server.get_json(f"/v1/conversations/{cid}")
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert page.locator("article.msg").count() == 2
    assert not ui.console_errors and not ui.page_errors


def test_markdown_renders_with_highlighted_code_and_a_copy_button(ui):
    page = ui.page
    type_and_send(page, MARKDOWN_SAMPLE)
    wait_for_answer_done(page)
    body = last_answer(page).locator(".msg-body")
    assert body.locator("h4").inner_text() == "Release notes"  # "#" under the message's <h3>
    assert body.locator("ol > li").count() == 2
    assert body.locator("table td").first.inner_text() == "echo-large"
    assert body.locator("code.hljs .hljs-keyword").count() >= 1
    link = body.get_by_role("link", name="links")
    assert link.get_attribute("target") == "_blank" and "noopener" in link.get_attribute("rel")
    copy = body.locator(".code-block .copy-button")
    assert copy.inner_text() == "Copy code"
    copy.click()
    wait_until(lambda: copy.inner_text() == "Copied")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied.startswith("def add(a: int, b: int) -> int:") and "return a + b" in copied
    ui.screenshot("markdown-light")
    assert not ui.console_errors and not ui.page_errors


def test_dark_theme_and_phone_layout(browser, ui_server):
    dark = open_page(browser, ui_server.base_url, color_scheme="dark")
    try:
        type_and_send(dark.page, MARKDOWN_SAMPLE)
        wait_for_answer_done(dark.page)
        background = dark.page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background != "rgb(255, 255, 255)"
        dark.screenshot("markdown-dark")
        cid = conversation_id(dark.page)
    finally:
        dark.close()
    for scheme in ("light", "dark"):
        phone = open_page(browser, ui_server.base_url, color_scheme=scheme, viewport=PHONE, path=f"/#{cid}")
        try:
            page = phone.page
            assert not page.locator("#sidebar").is_visible()
            phone.screenshot(f"phone-chat-{scheme}")
            page.get_by_role("button", name="Show conversations").click()
            page.locator("#sidebar").wait_for(state="visible")
            assert page.get_by_role("button", name="Show conversations").get_attribute("aria-expanded") == "true"
            page.wait_for_timeout(300)
            phone.screenshot(f"phone-sidebar-{scheme}")
            page.keyboard.press("Escape")
            page.locator("#sidebar").wait_for(state="hidden")
            assert not phone.console_errors
        finally:
            phone.close()


def test_shift_enter_adds_a_line_and_the_composer_is_labelled(ui):
    page = ui.page
    box = page.get_by_label("Message", exact=True)
    box.focus()
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert box.input_value() == "line one\nline two"
    assert page.locator("article.msg").count() == 0
    assert page.get_by_label("Model").is_visible()
    ui.screenshot("empty-light")


def test_rate_limited_send_shows_the_wait_and_gives_the_text_back(browser, tiny_model_dir, tmp_path):
    server = start_ui_server(tmp_path, tiny_model_dir, rpm=2)  # the new chat's creation and its first answer
    watched = open_page(browser, server.base_url)
    try:
        page = watched.page
        type_and_send(page, "one")
        wait_for_answer_done(page)
        type_and_send(page, "two")
        banner = page.get_by_role("alert")
        banner.wait_for(state="visible")
        text = banner.inner_text()
        assert "Rate limited" in text and " s." in text
        assert page.get_by_label("Message", exact=True).input_value() == "two"
        assert page.get_by_role("button", name="Retry").is_disabled()
        watched.screenshot("rate-limited-light")
        assert not watched.page_errors
    finally:
        watched.close()
        server.stop()


def test_a_queued_message_shows_its_place_and_estimated_wait(browser, tiny_model_dir, tmp_path):
    server = start_ui_server(tmp_path, tiny_model_dir, max_num_running=1)
    body = json.dumps(
        {"model": "echo-large", "max_tokens": 100, "messages": [{"role": "user", "content": " ".join(["busy"] * 100)}]}
    ).encode()
    request = urllib.request.Request(
        server.base_url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    busy = threading.Thread(target=lambda: urllib.request.urlopen(request, timeout=60).read())
    busy.start()  # holds echo-large's one running slot for about 5 s
    watched = open_page(browser, server.base_url)
    try:
        page = watched.page
        wait_until(
            lambda: (
                'chat_requests_reserved{model="echo-large"} 1.0'
                in urllib.request.urlopen(server.base_url + "/metrics", timeout=10).read().decode()
            )
        )
        type_and_send(page, "hello")
        status = page.locator("#status")
        wait_until(lambda: status.inner_text().startswith("Queued (position 1, about "))
        assert status.inner_text().rstrip("\u2026").endswith(" s)")
        wait_for_answer_done(page)
        assert last_answer(page).locator(".msg-body").inner_text().strip() == "hello"
        assert not watched.page_errors
    finally:
        watched.close()
        busy.join()
        server.stop()


def test_network_loss_mid_stream_shows_retry_and_retry_completes_after_restart(browser, tiny_model_dir, tmp_path):
    server = start_ui_server(tmp_path, tiny_model_dir)
    watched = open_page(browser, server.base_url)
    try:
        page = watched.page
        type_and_send(page, LONG_TEXT)
        wait_until(lambda: len(last_answer(page).locator(".msg-body").inner_text()) > 20)
        server.proc.kill()  # the connection drops mid-answer, as when the network goes
        banner = page.get_by_role("alert")
        banner.wait_for(state="visible")
        assert "Network connection lost" in banner.inner_text()
        watched.screenshot("network-lost-light")

        restarted = restart_ui_server(server)
        server = restarted
        page.get_by_role("button", name="Retry").click()
        wait_until(lambda: last_answer(page).locator(".msg-body").inner_text().strip() == LONG_TEXT, timeout_s=120)
        wait_for_answer_done(page)
        _, stored = server.get_json(f"/v1/conversations/{conversation_id(page)}")
        assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
        assert stored["messages"][1]["content"] == LONG_TEXT
        assert watched.dialogs == [] and watched.page_errors == []
    finally:
        watched.close()
        server.stop()


def test_a_new_chat_refused_for_the_rate_limit_gives_the_text_back(browser, tiny_model_dir, tmp_path):
    """Creating the conversation counts as a request too: the first answer of a new chat can be
    the one refused, and its text must not be lost."""
    server = start_ui_server(tmp_path, tiny_model_dir, rpm=1)
    watched = open_page(browser, server.base_url)
    try:
        page = watched.page
        type_and_send(page, "one")
        page.get_by_role("alert").wait_for(state="visible")
        assert "Rate limited" in page.get_by_role("alert").inner_text()
        assert page.get_by_label("Message", exact=True).input_value() == "one"
        assert not watched.page_errors
    finally:
        watched.close()
        server.stop()
