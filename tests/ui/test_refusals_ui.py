"""What the user reads when a send is refused or the connection misbehaves, and what they
keep: the text (resized to fit) and the attachment chips after a refusal, the error texts for
a too-long first message, an unreachable model, a fallback's reason, a rate limit that is
already over, an invalid key, a server that stops answering, and a drop after a whole answer."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import (
    last_answer,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)

pytestmark = pytest.mark.slow

CHAT = "**/v1/chat/completions"


def refuse(page, status: int, error: dict, headers: dict | None = None) -> None:
    """Every chat request answers `status` with an OpenAI-style error body."""
    page.route(
        CHAT,
        lambda route: route.fulfill(
            status=status, content_type="application/json", headers=headers or {}, body=json.dumps({"error": error})
        ),
    )


def banner_text(page) -> str:
    banner = page.locator("#banner")
    banner.wait_for(state="visible")
    return banner.inner_text()


def test_a_refused_send_keeps_the_attachment_chips(ui, tmp_path):
    page = ui.page
    notes = tmp_path / "notes.txt"
    notes.write_text("some notes")
    page.set_input_files("#attach-input", str(notes))
    page.locator("#attachments .attachment.uploaded").wait_for()
    refuse(page, 400, {"message": "No.", "type": "invalid_request_error", "code": "invalid_file", "param": "messages"})
    type_and_send(page, "Summarize this")
    banner_text(page)
    wait_for_answer_done(page)
    expect(page.get_by_label("Message", exact=True)).to_have_value("Summarize this")
    expect(page.locator("#attachments .attachment.uploaded")).to_have_count(1)
    assert "notes.txt" in page.locator("#attachments").inner_text()


def test_attaching_an_image_for_a_model_without_vision_warns_at_once(ui, tmp_path):
    page = ui.page

    def without_vision(route):
        models = route.fetch().json()
        for model in models["data"]:
            model["vision"] = False
        route.fulfill(content_type="application/json", body=json.dumps(models))

    page.route("**/v1/models", without_vision)
    page.reload()
    page.wait_for_selector("body.ready")
    page.set_input_files("#attach-input", files=[{"name": "cat.png", "mimeType": "image/png", "buffer": b"\x89PNG"}])
    expect(page.locator("#attachments .attachment")).to_contain_text("cannot read images")


def test_attaching_a_file_the_server_does_not_read_warns_at_once(ui):
    page = ui.page
    exe = {"name": "setup.exe", "mimeType": "application/x-msdownload", "buffer": b"MZ\x90\x00"}
    page.set_input_files("#attach-input", files=[exe])
    expect(page.locator("#attachments .attachment")).to_contain_text("Not a file type the server reads")


def test_text_given_back_after_a_refusal_grows_the_box_to_fit(ui):
    page = ui.page
    box = page.get_by_label("Message", exact=True)
    one_line = box.bounding_box()["height"]
    refuse(page, 400, {"message": "No.", "type": "invalid_request_error", "code": None, "param": None})
    type_and_send(page, "line one\nline two\nline three\nline four")
    banner_text(page)
    expect(box).to_have_value("line one\nline two\nline three\nline four")
    assert box.bounding_box()["height"] > 2 * one_line


def test_a_too_long_first_message_says_the_message_is_too_long(ui):
    page = ui.page
    message = (
        "This model's maximum context length is 16384 tokens. However, you requested 20000 tokens "
        "(19000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion."
    )
    refuse(page, 400, {"message": message, "type": "invalid_request_error", "code": "context_length_exceeded"})
    type_and_send(page, "a very long message")
    text = banner_text(page)
    assert "Your message is too long for the model (it reads at most 16,384 tokens)" in text
    assert "conversation is too long" not in text


def test_an_unreachable_model_says_so_and_suggests_another_model(ui):
    page = ui.page
    message = "The model is unavailable right now; please retry after the time in the Retry-After header."
    refuse(page, 503, {"message": message, "type": "server_error", "code": "model_unavailable"}, {"Retry-After": "5"})
    type_and_send(page, "hello")
    text = banner_text(page)
    assert text.startswith("The model is unavailable right now. Pick another model, or retry in ")
    assert "busy" not in text


def test_a_fallback_over_budget_is_labelled_with_its_reason(ui):
    page = ui.page

    def over_budget(route):
        response = route.fetch()
        headers = {**response.headers, "x-fallback-from": "echo-huge", "x-fallback-reason": "over_budget"}
        route.fulfill(response=response, headers=headers)

    page.route(CHAT, over_budget)
    type_and_send(page, "who answers?")
    wait_for_answer_done(page)
    wait_until(lambda: "fallback: over budget for echo-huge" in last_answer(page).locator(".msg-meta").inner_text())


def test_a_rate_limit_already_over_says_retry_now(ui):
    page = ui.page
    error = {"message": "Rate limit reached.", "type": "requests", "code": "rate_limit_exceeded"}
    refuse(page, 429, error, {"Retry-After": "0"})
    type_and_send(page, "too fast")
    text = banner_text(page)
    assert "You can retry now." in text and "0 s" not in text


def test_an_invalid_key_reads_as_a_sentence_without_a_shell_command(ui):
    page = ui.page
    page.get_by_role("button", name="Use an API key\u2026").click()
    page.locator("#key-input").fill("sk-" + "w" * 43)  # shaped like a key: a placeholder would be no key
    page.locator("#key-save").click()
    reason = page.locator("#key-reason")
    expect(reason).to_contain_text("operator")
    assert "server.py" not in reason.inner_text()


HUNG_FETCH = """() => {
  const real = window.fetch;
  window.fetch = (url, init) => {
    if (!String(url).includes("/v1/chat/completions")) return real(url, init);
    const chunk = {choices: [{index: 0, delta: {content: "Half an ans"}}]};
    const body = new ReadableStream({
      start(c) { c.enqueue(new TextEncoder().encode(`data: ${JSON.stringify(chunk)}\\n\\n`)); },
    });
    return Promise.resolve(new Response(body, {headers: {"Content-Type": "text/event-stream"}}));
  };
}"""


def test_a_server_that_stops_sending_gets_a_not_responding_hint(ui):
    page = ui.page
    page.clock.install()
    page.evaluate(HUNG_FETCH)  # the answer's first bytes arrive, then nothing, and the stream stays open
    type_and_send(page, "hello")
    wait_until(lambda: "Half an ans" in last_answer(page).locator(".msg-body").inner_text())
    page.clock.run_for(31_000)
    expect(page.locator("#status")).to_contain_text("not responding")
    assert page.get_by_role("button", name="Stop").is_visible()


def test_a_drop_after_a_whole_answer_does_not_offer_to_send_it_again(ui, ui_server):
    page = ui.page
    reads = []

    def drop_the_reread(route):
        reads.append(route.request.url)
        route.abort()  # the answer arrived whole; re-reading the chat afterwards fails

    page.route("**/v1/conversations/conv_*", drop_the_reread)
    type_and_send(page, "all of it")
    text = banner_text(page)
    wait_for_answer_done(page)
    assert "Network connection lost" not in text
    assert not page.get_by_role("button", name="Retry").is_visible()
    assert last_answer(page).locator(".msg-body").inner_text().strip() == "all of it"
