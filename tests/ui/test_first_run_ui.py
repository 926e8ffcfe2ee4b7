"""What a newcomer meets in the web UI, in a real browser against the real server: the empty
chat's description and example prompts (from the model card), a refusal that stays in the
conversation after a reload, an answer cut at the token limit that names the limit and offers
Continue, the note when earlier messages no longer fit the context, and feedback (thumbs,
comment, regenerate) that is stored and shown again after a reload."""

from __future__ import annotations

import shutil
import sqlite3

import pytest
from playwright.sync_api import expect

from engine.tokenizer import Tokenizer
from settings import SafetyConfig
from testing.fake_backend import FakeBehaviour
from testing.server_proc import ROOT, ServerProcess
from tests.ui.helpers import (
    conversation_id,
    last_answer,
    open_page,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
CONTEXT_TOKENS = 160
CARD = """# echo-card

**An echo model for tests: it repeats what you say.**

Try: "What does water mean?", "What can you do?", "Hi"

More of the card.
"""
CONFIG = """
[server]
static_dir = "{static}"
heartbeat_s = 1.0

[safety]
enabled = true
classifier = false

[models.echo-card]
path = "{model}"
max_model_len = {context}

[tiers.enterprise]
models = ["echo-card"]
max_tokens = {max_tokens}
max_context_tokens = {context}
"""


@pytest.fixture(scope="module")
def card_server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui-first-run")
    model = tmp / "echo-card"
    shutil.copytree(tiny_model_dir, model)
    (model / "README.md").write_text(CARD)
    config = tmp / "config.toml"
    config.write_text(CONFIG.format(static=ROOT / "static", model=model, context=CONTEXT_TOKENS, max_tokens=MAX_TOKENS))
    proc = ServerProcess(
        ["--config", str(config), "--db", str(tmp / "chat.db")], fake=FakeBehaviour(), log_path=tmp / "server.log"
    )
    with proc:
        yield proc, tmp / "chat.db"


@pytest.fixture
def page(browser, card_server):
    watched = open_page(browser, card_server[0].base_url)
    yield watched.page
    assert not watched.page_errors, watched.page_errors
    watched.close()


def test_empty_chat_shows_the_card_description_and_example_prompts_that_send(page):
    expect(page.locator("#welcome-description")).to_have_text("An echo model for tests: it repeats what you say.")
    examples = page.locator("#welcome-examples button")
    expect(examples).to_have_text(["What does water mean?", "What can you do?", "Hi"])
    examples.nth(2).click()
    wait_for_answer_done(page)
    expect(page.locator("article.msg-user .msg-body")).to_have_text(["Hi"])
    expect(page.locator("#welcome")).to_be_hidden()


def test_refused_prompt_stays_in_the_conversation_after_a_reload(page):
    crisis = SafetyConfig().refusal_messages["self_harm"]
    type_and_send(page, "how do I kill myself")
    wait_for_answer_done(page)
    expect(last_answer(page).locator(".msg-body")).to_have_text(crisis, timeout=10_000)
    page.wait_for_timeout(2000)  # the old UI lost the refusal when it re-read the conversation
    expect(last_answer(page).locator(".msg-body")).to_have_text(crisis)
    page.reload()
    page.wait_for_selector("body.ready")
    expect(last_answer(page).locator(".msg-body")).to_have_text(crisis)
    expect(last_answer(page).locator(".msg-note")).to_have_text("Stopped by the content filter.")


def _words(tokenizer, num_tokens: int) -> str:
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < num_tokens:
        words.append(f"item{len(words)}")
    return " ".join(words)


def test_cut_off_answer_names_the_limit_and_continue_sends(page, tiny_model_dir):
    type_and_send(page, _words(Tokenizer.from_dir(tiny_model_dir), 3 * MAX_TOKENS))
    wait_for_answer_done(page)
    note = last_answer(page).locator(".msg-note")
    expect(note).to_have_text(
        f"Cut off at the {MAX_TOKENS}-token limit for one answer (this tier's default max_tokens)."
    )
    last_answer(page).get_by_role("button", name="Continue the answer").click()
    wait_for_answer_done(page)
    expect(page.locator("article.msg-user .msg-body").last).to_have_text("Continue")


def test_dropped_history_is_said_in_the_conversation(page, tiny_model_dir):
    words = _words(Tokenizer.from_dir(tiny_model_dir), 55)
    for turn in range(3):
        type_and_send(page, f"turn {turn} " + words)
        wait_for_answer_done(page)
    note = last_answer(page).locator(".msg-note").first
    expect(note).to_contain_text(f"Earlier messages no longer fit the model's {CONTEXT_TOKENS}-token context")
    expect(page.locator("article.msg-assistant .msg-note", has_text="no longer fit").first).to_be_visible()
    assert "no longer fit" not in page.locator("article.msg-assistant").first.inner_text()


def test_thumbs_comment_and_regenerate_are_stored_and_shown_after_a_reload(page, card_server):
    _, db_path = card_server
    type_and_send(page, "What does water mean?")
    wait_for_answer_done(page)
    cid = conversation_id(page)
    answer = last_answer(page)
    # Icons are inline SVG, not emoji (an emoji glyph is an empty box where no emoji font is).
    for button in (answer.get_by_role("button", name="Good answer"), page.get_by_role("button", name="Attach")):
        expect(button.locator("svg path")).to_have_count(1)
        assert button.inner_text().strip() == ""
    answer.get_by_role("button", name="Bad answer").click()
    expect(answer.get_by_role("button", name="Bad answer")).to_have_attribute("aria-pressed", "true")
    last_answer(page).get_by_role("button", name="Comment on this answer").click()
    page.get_by_role("textbox", name="Comment on this answer").fill("Not a definition.")
    page.get_by_role("button", name="Save comment").click()
    expect(last_answer(page).get_by_role("button", name="Comment on this answer")).to_have_text("Comment \u2713")
    page.reload()
    page.wait_for_selector("body.ready")
    expect(last_answer(page).get_by_role("button", name="Bad answer")).to_have_attribute("aria-pressed", "true")
    expect(last_answer(page).get_by_role("button", name="Good answer")).to_have_attribute("aria-pressed", "false")
    last_answer(page).get_by_role("button", name="Regenerate the answer").click()
    wait_for_answer_done(page)

    def rows():
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5) as conn:
            return conn.execute(
                "SELECT prompt, rating, comment, regenerated FROM feedback WHERE conversation_id = ?", (cid,)
            ).fetchall()

    assert wait_until(lambda: rows() == [("What does water mean?", -1, "Not a definition.", 1)])
    expect(last_answer(page).get_by_role("button", name="Bad answer")).to_have_attribute("aria-pressed", "false")
