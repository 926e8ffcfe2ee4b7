"""The chat at phone widths in a real browser: at 320 CSS px (a small phone, or a desktop
window at 400% zoom, WCAG's reflow width) and 390 px nothing scrolls sideways, every control of
the top bar and of an answer stays on screen, and the open chat's title stays readable."""

from __future__ import annotations

import pytest

from tests.ui.helpers import PHONE, conversation_id, open_page, type_and_send, wait_for_answer_done, wait_until

pytestmark = pytest.mark.slow

SMALL_PHONE = {"width": 320, "height": 640}
TITLE = "Quarterly planning notes for the garden club"

# Visible controls of the top bar and of the messages' action rows that leave the viewport.
OFF_SCREEN = """() => Array.from(document.querySelectorAll(
    '.topbar button, .topbar select, .msg-actions button'))
  .filter((e) => e.offsetParent !== null)
  .map((e) => [e.getAttribute('aria-label') || e.textContent.trim(), e.getBoundingClientRect()])
  .filter(([, r]) => r.left < 0 || r.right > window.innerWidth)
  .map(([name, r]) => `${name}: ${Math.round(r.left)}..${Math.round(r.right)}`)"""


@pytest.fixture(scope="module")
def chat_id(browser, ui_server):
    watched = open_page(browser, ui_server.base_url)
    try:
        type_and_send(watched.page, TITLE)
        wait_for_answer_done(watched.page)
        return conversation_id(watched.page)
    finally:
        watched.close()


@pytest.mark.parametrize("viewport", [SMALL_PHONE, PHONE], ids=["320px", "390px"])
def test_an_open_chat_fits_the_width_with_every_control_on_screen(browser, ui_server, chat_id, viewport):
    watched = open_page(browser, ui_server.base_url, viewport=viewport, path=f"/#{chat_id}")
    try:
        page = watched.page
        page.locator("article.msg-assistant .msg-actions").wait_for()
        watched.screenshot(f"narrow-chat-{viewport['width']}")
        widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert widths[0] <= widths[1], f"the page scrolls sideways: {widths}"
        assert page.evaluate(OFF_SCREEN) == []
        # Beside Download, Share and the model picker the title was squeezed to "Qu…".
        title_width = page.locator("#chat-title").evaluate("(e) => e.getBoundingClientRect().width")
        assert title_width >= 100, f"the title is {title_width}px wide"
    finally:
        watched.close()


def test_the_action_row_of_an_answer_stays_one_row_at_390px(browser, ui_server, chat_id):
    watched = open_page(browser, ui_server.base_url, viewport=PHONE, path=f"/#{chat_id}")
    try:
        actions = watched.page.locator("article.msg-assistant .msg-actions").last
        actions.wait_for()
        tops = actions.locator("button").evaluate_all("(bs) => bs.map((b) => b.getBoundingClientRect().top)")
        assert max(tops) - min(tops) < 10, f"the buttons sit on more than one row: {tops}"  # icons: a px or two
    finally:
        watched.close()


WIDE_TABLE = """| model | tokens | a long column header | another long column header | more |
|-------|--------|------|-----|----|
| echo-large | 42 | some long cell text here | more long cell text here | x |
"""


def test_a_table_wider_than_a_phone_is_a_named_region_that_scrolls_by_keyboard(browser, ui_server):
    watched = open_page(browser, ui_server.base_url, viewport=PHONE)
    try:
        page = watched.page
        type_and_send(page, WIDE_TABLE)
        wait_for_answer_done(page)
        scroller = page.locator("article.msg-assistant").last.get_by_role("region", name="Table")
        assert scroller.get_attribute("tabindex") == "0"  # Safari, unlike Chromium, skips a bare scroller
        assert scroller.evaluate("(e) => e.scrollWidth > e.clientWidth"), "the sample must overflow"
        scroller.focus()
        page.keyboard.press("ArrowRight")
        wait_until(lambda: scroller.evaluate("(e) => e.scrollLeft") > 0)
    finally:
        watched.close()
