"""The attachment chips above the message box, by keyboard: removing one with its Remove button
keeps the keyboard among the chips (the next one, else the one before), then on the Attach
button once none is left; focus never falls to <body>. A refused file's reason is readable
(4.5:1) in both themes."""

from __future__ import annotations

import pytest

from tests.ui.helpers import open_page, wait_until
from tests.ui.test_accessibility_ui import contrast

pytestmark = pytest.mark.slow


def focused_name(page) -> str:
    return page.evaluate(
        "(() => { const e = document.activeElement; return e.getAttribute('aria-label') || e.tagName; })()"
    )


def test_removing_a_chip_moves_focus_to_its_neighbour_then_to_attach(ui):
    page = ui.page
    files = [{"name": f"{name}.txt", "mimeType": "text/plain", "buffer": name.encode()} for name in ("a", "b", "c")]
    page.locator("#attach-input").set_input_files(files)
    chips = page.locator("#attachments .attachment.uploaded")
    wait_until(lambda: chips.count() == 3)

    page.get_by_role("button", name="Remove b.txt").focus()
    page.keyboard.press("Enter")
    assert focused_name(page) == "Remove c.txt"  # the chip that took its place
    page.keyboard.press("Enter")
    assert focused_name(page) == "Remove a.txt"  # the last one gone: the one before
    page.keyboard.press("Enter")
    assert focused_name(page) == "Attach images or files"
    assert page.locator("#attachments").is_hidden()
    assert not ui.console_errors and not ui.page_errors


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_a_refused_files_reason_reaches_4_5_to_1(browser, ui_server, scheme):
    watched = open_page(browser, ui_server.base_url, color_scheme=scheme)
    try:
        page = watched.page
        big = {"name": "big.txt", "mimeType": "text/plain", "buffer": b"a" * (20 * 1024 * 1024 + 1)}
        page.locator("#attach-input").set_input_files([big])
        detail = page.locator(".attachment-error .attachment-detail")
        assert detail.inner_text().startswith("Too large")
        colours = detail.evaluate(
            "(e) => ({fg: getComputedStyle(e).color, bg: getComputedStyle(e.closest('.attachment')).backgroundColor})"
        )
        assert contrast(colours["fg"], colours["bg"]) >= 4.5  # the dark theme's was 3.2:1
    finally:
        watched.close()
