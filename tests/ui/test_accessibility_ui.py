"""Accessibility of the chat UI in a real browser: dialogs opened from the phone drawer keep the
keyboard, finished answers and copies are announced once in a hidden status region, focus lands
on a sensible element after each action, code blocks scroll by keyboard, the drawer makes the
chat inert, colours reach WCAG AA (ratios computed here from getComputedStyle, no axe install),
and names, headings and focus rings hold up."""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import (
    PHONE,
    last_answer,
    open_page,
    start_ui_server,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)

pytestmark = pytest.mark.slow

ZOOMED = {"width": 640, "height": 410}  # a 1280x820 window at 200% zoom
CODE_SAMPLE = """```python
def greet(name):  # a comment
    print("Hello, " + name + "! This line is long enough that it has to scroll sideways inside its block.")
    return len(name) > 3
```

```html
<a href="/docs" class="link">Docs</a>
```

```markdown
# A heading
```

```diff
+ added line
- removed line
```
"""

# The colour an element's text shows on: its own background, else the nearest ancestor's.
COLOURS_JS = """(el) => {
  let back = null;
  for (let e = el; e && !back; e = e.parentElement) {
    const c = getComputedStyle(e).backgroundColor;
    if (c !== 'transparent' && !/^rgba\\(.*,\\s*0\\)$/.test(c)) back = c;
  }
  return {fg: getComputedStyle(el).color, bg: back || getComputedStyle(document.body).backgroundColor};
}"""

# How far the focused element's outline reaches past the inner edge of each ancestor that clips
# (overflow other than visible); its own overflow does not clip its outline.
RING_CLIP_JS = """(el) => {
  const cs = getComputedStyle(el);
  const ring = cs.outlineStyle === 'none' ? 0 : parseFloat(cs.outlineWidth) + parseFloat(cs.outlineOffset);
  const r = el.getBoundingClientRect();
  const cut = [];
  for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
    const s = getComputedStyle(a);
    if (s.overflowX === 'visible' && s.overflowY === 'visible') continue;
    const c = a.getBoundingClientRect();
    const over = Math.max(
      c.top + parseFloat(s.borderTopWidth) - (r.top - ring),
      c.left + parseFloat(s.borderLeftWidth) - (r.left - ring),
      r.right + ring - (c.right - parseFloat(s.borderRightWidth)),
      r.bottom + ring - (c.bottom - parseFloat(s.borderBottomWidth)));
    if (over > 0.5) cut.push(`${a.tagName.toLowerCase()}.${a.className}: ${over}px`);
  }
  return {outline: `${cs.outlineStyle} ${cs.outlineWidth}`, cut};
}"""

# Every text the status region shows, in order (the observer is added through CDP, not a script
# tag, so the page's CSP allows it).
RECORD_ANNOUNCEMENTS_JS = """() => {
  window.__said = [];
  const region = document.getElementById('announcer');
  new MutationObserver(() => { if (region.textContent) window.__said.push(region.textContent); })
    .observe(region, {childList: true, characterData: true, subtree: true});
}"""


def parse_rgb(css: str) -> tuple[float, float, float]:
    numbers = re.findall(r"[\d.]+", css)
    assert css.startswith("rgb") and len(numbers) >= 3, css
    assert len(numbers) == 3 or float(numbers[3]) == 1, f"not opaque: {css}"
    return tuple(float(n) for n in numbers[:3])


def contrast(fg_css: str, bg_css: str) -> float:
    """WCAG 2 contrast ratio of two opaque computed colours."""

    def luminance(css: str) -> float:
        r, g, b = (c / 255 for c in parse_rgb(css))
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    high, low = sorted((luminance(fg_css), luminance(bg_css)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def text_contrast(locator) -> float:
    colours = locator.evaluate(COLOURS_JS)
    return contrast(colours["fg"], colours["bg"])


def focused(page, selector: str) -> bool:
    return page.evaluate("(s) => document.activeElement === document.querySelector(s)", selector)


def focused_label(page) -> str:
    return page.evaluate(
        "(() => { const e = document.activeElement; return e === document.body ? 'BODY'"
        " : (e.getAttribute('aria-label') || e.textContent || e.id).trim(); })()"
    )


def with_a_chat(page, text: str = "hello") -> None:
    type_and_send(page, text)
    wait_for_answer_done(page)


# ---- 1. dialogs opened from the phone drawer --------------------------------------------
@pytest.mark.parametrize("viewport", [PHONE, ZOOMED], ids=["phone", "zoomed-200"])
def test_a_dialog_opened_from_the_phone_drawer_keeps_tab_and_escape_to_itself(browser, ui_server, viewport):
    watched = open_page(browser, ui_server.base_url, viewport=viewport)
    try:
        page = watched.page
        with_a_chat(page, "a chat to delete later")
        page.get_by_role("button", name="Show conversations").click()
        delete = page.locator("#conversation-list .conv-delete").first
        delete.focus()
        page.keyboard.press("Enter")
        expect(page.locator("#confirm-dialog")).to_be_visible()
        seen = set()
        for key in ("Tab", "Shift+Tab"):  # past its last button, Chromium lets Tab go to the browser's own UI
            page.keyboard.press(key)
            assert page.evaluate("document.getElementById('confirm-dialog').contains(document.activeElement)")
            seen.add(focused_label(page))
        assert seen == {"Cancel", "Delete"}, "Tab must move between the dialog's buttons"
        page.keyboard.press("Escape")
        expect(page.locator("#confirm-dialog")).to_be_hidden()
        assert page.evaluate("document.getElementById('sidebar').classList.contains('open')"), "only the dialog closes"
        assert page.evaluate("document.activeElement.matches('#conversation-list .conv-delete')")
        assert page.locator("#conversation-list .conv-delete").first.evaluate("(e) => e === document.activeElement")

        page.locator("#open-key").focus()
        page.keyboard.press("Enter")
        expect(page.locator("#key-dialog")).to_be_visible()
        page.keyboard.press("Tab")
        assert focused_label(page) == "Forget key"
        page.keyboard.press("Escape")
        expect(page.locator("#key-dialog")).to_be_hidden()
        assert page.evaluate("document.getElementById('sidebar').classList.contains('open')")
        assert focused(page, "#open-key")
        assert not watched.page_errors
    finally:
        watched.close()


def test_escape_in_a_rename_inside_the_drawer_cancels_only_the_rename(browser, ui_server):
    watched = open_page(browser, ui_server.base_url, viewport=PHONE)
    try:
        page = watched.page
        with_a_chat(page, "a chat to rename")
        page.get_by_role("button", name="Show conversations").click()
        page.locator("#conversation-list .conv-rename").first.click()
        page.get_by_role("textbox", name="New title").press("Escape")
        expect(page.get_by_role("textbox", name="New title")).to_have_count(0)
        assert page.evaluate("document.getElementById('sidebar').classList.contains('open')")
        assert page.evaluate("document.activeElement.matches('#conversation-list .conv-rename')")
    finally:
        watched.close()


# ---- 2. one polite status region: an answer finished, a copy -----------------------------
def test_a_finished_answer_and_a_copy_are_announced_once_in_a_hidden_status_region(ui):
    page = ui.page
    region = page.locator("#announcer")
    assert region.get_attribute("role") == "status" and region.get_attribute("aria-live") == "polite"
    box = region.bounding_box()
    assert box is None or (box["width"] <= 1 and box["height"] <= 1), "the region is visually hidden"
    page.evaluate(RECORD_ANNOUNCEMENTS_JS)
    with_a_chat(page, "one two three four five six seven eight")
    wait_until(lambda: page.evaluate("window.__said.length") > 0)
    page.wait_for_timeout(300)
    assert page.evaluate("window.__said") == ["Answer complete."], "once per answer, never the tokens"

    page.get_by_role("button", name="Copy message 2").click()
    expect(region).to_have_text("Copied")
    page.evaluate("() => { navigator.clipboard.writeText = () => Promise.reject(new Error('denied')); }")
    page.get_by_role("button", name="Copy message 1").click()
    expect(region).to_have_text("Copy failed")


def test_the_usage_line_is_not_a_live_region(ui):
    usage = ui.page.locator("#usage-summary")
    assert usage.evaluate("(e) => e.closest('[aria-live], [role=status], [role=alert], [role=log]')") is None


# ---- 3, 7, 8. colours -----------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_danger_buttons_reach_4_5_to_1(browser, ui_server, scheme):
    watched = open_page(browser, ui_server.base_url, color_scheme=scheme)
    try:
        for selector in ("#confirm-ok", "#stop"):  # computed even while hidden
            assert text_contrast(watched.page.locator(selector)) >= 4.5, selector
    finally:
        watched.close()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_message_box_placeholder_reaches_4_5_to_1(browser, ui_server, scheme):
    watched = open_page(browser, ui_server.base_url, color_scheme=scheme)
    try:
        box = watched.page.locator("#composer-input")
        placeholder = box.evaluate("(e) => getComputedStyle(e, '::placeholder').color")
        assert contrast(placeholder, box.evaluate(COLOURS_JS)["bg"]) >= 4.5
    finally:
        watched.close()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_highlighted_code_tokens_reach_4_5_to_1(browser, ui_server, scheme):
    watched = open_page(browser, ui_server.base_url, color_scheme=scheme)
    try:
        page = watched.page
        with_a_chat(page, CODE_SAMPLE)
        tokens = last_answer(page).locator(".code-block span[class^='hljs-']")
        assert last_answer(page).locator(".code-block .hljs-keyword").count() >= 1
        low = {}
        for i in range(tokens.count()):
            token = tokens.nth(i)
            ratio = text_contrast(token)
            if ratio < 4.5:
                low[token.get_attribute("class")] = round(ratio, 2)
        assert low == {}
    finally:
        watched.close()


# ---- 4. focus after actions ------------------------------------------------------------
def test_deleting_a_chat_focuses_its_neighbour_then_new_chat(browser, tiny_model_dir, tmp_path):
    server = start_ui_server(tmp_path, tiny_model_dir)  # its own list: exactly these two chats
    watched = open_page(browser, server.base_url)
    try:
        page = watched.page
        with_a_chat(page, "older chat")
        page.get_by_role("button", name="+ New chat").click()
        with_a_chat(page, "newer chat")

        def delete(title: str) -> None:
            page.get_by_role("button", name=f"Delete {title}").click()
            page.locator("#confirm-ok").click()
            expect(page.get_by_role("button", name=f"Delete {title}")).to_have_count(0)

        delete("older chat")  # the last in the list: the one before it takes the focus
        wait_until(lambda: focused_label(page) == "newer chat")
        delete("newer chat")  # the open chat and the only one left
        wait_until(lambda: focused(page, "#new-chat"))
        assert not watched.page_errors
    finally:
        watched.close()
        server.stop()


def test_cancel_and_escape_in_the_comment_form_return_focus_to_the_comment_button(ui):
    page = ui.page
    with_a_chat(page, "rate me")
    answer = last_answer(page)
    comment = answer.get_by_role("button", name="Comment on this answer")
    comment.click()
    answer.get_by_role("button", name="Cancel").click()
    wait_until(lambda: comment.evaluate("(e) => e === document.activeElement"))

    comment.click()
    answer.get_by_role("textbox", name="Comment on this answer").press("Escape")
    expect(answer.locator(".feedback-form")).to_have_count(0)
    wait_until(lambda: comment.evaluate("(e) => e === document.activeElement"))


def test_good_and_bad_keep_focus_and_show_their_state(ui):
    page = ui.page
    with_a_chat(page, "rate me too")
    answer = last_answer(page)
    good = answer.get_by_role("button", name="Good answer")
    bad = answer.get_by_role("button", name="Bad answer")
    good.click()
    expect(good).to_have_attribute("aria-pressed", "true")
    wait_until(lambda: good.evaluate("(e) => e === document.activeElement"))
    page.keyboard.press("Tab")  # the keyboard goes on from there, not from the message box
    assert bad.evaluate("(e) => e === document.activeElement")
    page.keyboard.press("Enter")
    expect(bad).to_have_attribute("aria-pressed", "true")
    expect(good).to_have_attribute("aria-pressed", "false")
    wait_until(lambda: bad.evaluate("(e) => e === document.activeElement"))


# ---- 5. code blocks scroll by keyboard -----------------------------------------------
def test_a_code_block_is_a_named_focusable_region_that_scrolls_by_keyboard(ui):
    page = ui.page
    with_a_chat(page, CODE_SAMPLE)
    scroller = last_answer(page).get_by_role("region", name="Code, python")
    assert scroller.evaluate("(e) => e.tagName") == "PRE" and scroller.get_attribute("tabindex") == "0"
    assert scroller.evaluate("(e) => e.scrollWidth > e.clientWidth"), "the sample must overflow"
    last_answer(page).locator(".code-block .copy-button").first.focus()
    page.keyboard.press("Tab")
    assert scroller.evaluate("(e) => e === document.activeElement")
    scroller.evaluate("(e) => e.scrollIntoView({block: 'center'})")
    ring = scroller.evaluate(RING_CLIP_JS)
    assert ring["outline"].startswith("solid") and ring["cut"] == [], ring
    page.keyboard.press("ArrowRight")
    wait_until(lambda: scroller.evaluate("(e) => e.scrollLeft") > 0)


# ---- 6. the phone drawer makes the chat inert -------------------------------------------
def test_the_open_phone_drawer_makes_the_chat_inert_until_it_closes(browser, ui_server):
    watched = open_page(browser, ui_server.base_url, viewport=PHONE)
    try:
        page = watched.page
        main = page.locator("main")
        assert main.evaluate("(e) => e.inert") is False
        page.get_by_role("button", name="Show conversations").click()
        assert main.evaluate("(e) => e.inert") is True
        page.locator("#composer-input").evaluate("(e) => e.focus()")
        assert not focused(page, "#composer-input")
        page.keyboard.press("Escape")
        assert main.evaluate("(e) => e.inert") is False
        assert focused(page, "#open-sidebar")
    finally:
        watched.close()


# ---- 9, 10. the composer ---------------------------------------------------------------
def test_the_composer_grows_to_a_share_of_a_zoomed_window_only(browser, ui_server):
    watched = open_page(browser, ui_server.base_url, viewport=ZOOMED)
    try:
        page = watched.page
        box = page.get_by_label("Message", exact=True)
        box.fill("\n".join(f"line {i}" for i in range(40)))
        height = box.evaluate("(e) => e.getBoundingClientRect().height")
        assert 40 < height <= 0.3 * ZOOMED["height"] + 1
    finally:
        watched.close()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_focused_composer_shows_a_2px_ring_of_3_to_1(browser, ui_server, scheme):
    watched = open_page(browser, ui_server.base_url, color_scheme=scheme)
    try:
        page = watched.page
        page.get_by_label("Message", exact=True).focus()
        ring = page.locator("#composer").evaluate(
            "(e) => { const s = getComputedStyle(e); return {style: s.outlineStyle, width: s.outlineWidth,"
            " colour: s.outlineColor, around: getComputedStyle(e.parentElement).backgroundColor"
            " === 'rgba(0, 0, 0, 0)' ? getComputedStyle(document.body).backgroundColor"
            " : getComputedStyle(e.parentElement).backgroundColor}; }"
        )
        assert ring["style"] == "solid" and float(ring["width"].rstrip("px")) >= 2, ring
        assert contrast(ring["colour"], ring["around"]) >= 3
    finally:
        watched.close()


# ---- 11, 12. names and headings --------------------------------------------------------
def test_each_copy_button_names_its_message(ui):
    page = ui.page
    with_a_chat(page, "copy me")
    names = page.locator("#messages .msg-actions .copy-button").evaluate_all(
        "(all) => all.map((e) => e.getAttribute('aria-label') || e.textContent)"
    )
    assert names == ["Copy message 1", "Copy message 2"]
    assert page.locator("#messages .msg-actions .copy-button").first.inner_text() == "Copy"  # label in name


def test_markdown_headings_sit_below_the_message_heading(ui):
    page = ui.page
    with_a_chat(page, "# Top\n\ntext\n\n## Second\n\n### Third\n\n#### Fourth")
    body = last_answer(page).locator(".msg-body")
    levels = body.locator("h1, h2, h3, h4, h5, h6").evaluate_all("(all) => all.map((h) => h.tagName)")
    assert levels == ["H4", "H5", "H6", "H6"]
    assert body.locator("h4").inner_text() == "Top"


# ---- 13. minor ----------------------------------------------------------------------------
def test_example_prompts_are_a_named_group(ui):
    page = ui.page

    def with_examples(route):
        models = route.fetch().json()
        for model in models["data"]:
            model["example_prompts"] = ["Say hello", "Say goodbye"]
        route.fulfill(content_type="application/json", body=json.dumps(models))

    page.route("**/v1/models", with_examples)
    page.reload()
    page.wait_for_selector("body.ready")
    group = page.get_by_role("group", name="Example prompts")
    expect(group.get_by_role("button")).to_have_count(2)


def test_the_model_picker_is_named_once(ui):
    snapshot = ui.page.locator("header.topbar").aria_snapshot()
    assert 'combobox "Model"' in snapshot
    assert "text: Model" not in snapshot, snapshot


def test_the_first_conversation_focus_ring_is_not_clipped(ui):
    page = ui.page
    with_a_chat(page, "first in the list")
    page.locator("#new-chat").focus()
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "conversation-search"  # the search box comes first
    page.keyboard.press("Tab")
    first = page.locator("#conversation-list .conv-open").first
    assert first.evaluate("(e) => e === document.activeElement")
    ring = first.evaluate(RING_CLIP_JS)
    assert ring["outline"].startswith("solid") and ring["cut"] == [], ring
