"""The attachment chips above the message box, by keyboard: removing one with its Remove button
keeps the keyboard among the chips (the next one, else the one before), then on the Attach
button once none is left; focus never falls to <body>."""

from __future__ import annotations

import pytest

from tests.ui.helpers import wait_until

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
