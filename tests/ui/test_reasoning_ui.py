"""A reasoning model in the browser: its thinking streams into a folded "Reasoning" block
above the answer, and the answer itself holds only the text after </think>."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.api.helpers import THINKING_TEMPLATE
from tests.ui.helpers import last_answer, open_page, start_ui_server, type_and_send, wait_for_answer_done

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def thinking_server(tiny_model_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    server = start_ui_server(tmp_path_factory.mktemp("ui-thinking"), model_dir)
    try:
        yield server
    finally:
        server.stop()


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
        assert not watched.console_errors and not watched.page_errors
    finally:
        watched.close()
