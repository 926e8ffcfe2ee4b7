"""Attachments in the real browser against a server with a (tiny) vision model: attach an
image and a text file, see thumbnails and finished uploads, send, and see both again after a
reload; a file over the upload limit is refused before any byte is sent."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from testing.server_proc import ROOT, ServerProcess
from testing.tiny_llava import build_tiny_llava
from tests.ui.helpers import (
    conversation_id,
    open_page,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)

pytestmark = pytest.mark.slow

CONFIG = """
[server]
static_dir = "{static}"

[safety]
enabled = false

[engine]
device = "cpu"
kv_cache_bytes = 4000000
native_kernels = false

[files]
max_file_bytes = 200000

[models.vision]
path = "{model}"
backend = "native"

[tiers.enterprise]
models = ["vision"]
"""


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui-vision")
    model = build_tiny_llava(tmp / "tiny-llava")
    config = tmp / "config.toml"
    config.write_text(CONFIG.format(static=ROOT / "static", model=model))
    proc = ServerProcess(["--config", str(config), "--db", str(tmp / "chat.db")], log_path=tmp / "server.log")
    proc.start()
    try:
        yield proc
    finally:
        proc.__exit__(None, None, None)


def png(color=(220, 40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buf, format="PNG")
    return buf.getvalue()


def test_attach_an_image_and_a_text_file_send_and_see_them_after_a_reload(browser, vision_server, tmp_path):
    watched = open_page(browser, vision_server.base_url)
    page = watched.page
    try:
        page.set_input_files(
            "#attach-input",
            [
                {"name": "red.png", "mimeType": "image/png", "buffer": png()},
                {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"The meeting is at noon."},
            ],
        )
        chips = page.locator("#attachments .attachment")
        chips.nth(1).wait_for()
        wait_until(lambda: page.locator("#attachments .attachment.uploaded").count() == 2)
        assert page.locator("#attachments .attachment-thumb").count() == 1  # the image has a thumbnail
        type_and_send(page, "What is in these?")
        wait_for_answer_done(page)
        user = page.locator("article.msg-user").last
        assert user.locator(".msg-attachments .attachment").count() == 2
        cid = conversation_id(page)
        assert cid.startswith("conv_")

        page.reload()
        page.wait_for_selector("body.ready")
        user = page.locator("article.msg-user").last
        user.locator(".msg-attachments .attachment-thumb").wait_for()
        wait_until(lambda: "notes.txt" in user.locator(".attachment-name").all_inner_texts())
        assert user.locator(".msg-body").inner_text() == "What is in these?"
        src = user.locator(".attachment-thumb").get_attribute("src")
        assert src.startswith("data:image/png;base64,")
        assert not watched.page_errors and not watched.foreign_requests()
    finally:
        watched.close()


def test_a_file_over_the_limit_is_refused_before_upload(browser, vision_server):
    watched = open_page(browser, vision_server.base_url)
    page = watched.page
    try:
        page.set_input_files("#attach-input", [{"name": "big.txt", "mimeType": "text/plain", "buffer": b"x" * 300_000}])
        chip = page.locator("#attachments .attachment-error")
        chip.wait_for()
        assert "the limit is 195.3 KB" in chip.inner_text()
        assert not [u for u in watched.requests if u.endswith("/v1/files") and "limit" not in u]
    finally:
        watched.close()


def test_a_file_an_api_client_sent_inline_shows_as_a_chip_with_its_name_and_size(browser, vision_server):
    """An API client's file_data (or an Anthropic document block) is stored in its message: the
    web UI lists it with the other attachments instead of leaving it out."""
    import base64
    import json
    import urllib.error
    import urllib.request

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{vision_server.base_url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(exc.read().decode()) from None

    data = base64.b64encode(b"The meeting is at noon. " * 10).decode()
    part = {"type": "file", "file": {"filename": "minutes.txt", "file_data": f"data:text/plain;base64,{data}"}}
    conv = post("/v1/conversations", {})["id"]
    body = {
        "model": "vision",
        "conversation_id": conv,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "When is it?"}, part]}],
    }
    assert post("/v1/chat/completions", body)["choices"]
    watched = open_page(browser, vision_server.base_url, path=f"/#{conv}")
    page = watched.page
    try:
        user = page.locator("article.msg-user").last
        user.locator(".msg-attachments .attachment").wait_for()
        assert user.locator(".attachment-name").all_inner_texts() == ["minutes.txt"]
        assert user.locator(".attachment-detail").inner_text() == "240 B, sent inline"
        assert not watched.page_errors
    finally:
        watched.close()
