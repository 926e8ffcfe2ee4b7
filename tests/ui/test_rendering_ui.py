"""How messages look: task lists keep their boxes, an image without a loadable address is its
alt text (never a link to the app), inline code in a narrow table column stays whole, text
direction follows the text, and a sent message's attachments sit with the user's bubble."""

from __future__ import annotations

import pytest

from tests.ui.helpers import last_answer, type_and_send, wait_for_answer_done

pytestmark = pytest.mark.slow


def answer_body(page):
    return last_answer(page).locator(".msg-body")


def test_task_list_items_keep_their_checked_and_empty_boxes(ui):
    page = ui.page
    type_and_send(page, "- [x] buy milk\n- [ ] call home")
    wait_for_answer_done(page)
    items = answer_body(page).locator("li").all_inner_texts()
    assert items == ["\u2611buy milk", "\u2610call home"] or items == ["\u2611 buy milk", "\u2610 call home"]


@pytest.mark.parametrize("src", ["javascript:alert(1)", ""])
def test_an_image_without_a_loadable_address_shows_only_its_alt_text(ui, src):
    page = ui.page
    type_and_send(page, f"See ![a drawing of a cat]({src}) here")
    wait_for_answer_done(page)
    body = answer_body(page)
    assert "a drawing of a cat" in body.inner_text()
    assert body.locator("a").count() == 0


def test_inline_code_in_a_narrow_table_column_is_not_broken_mid_word(ui):
    page = ui.page
    row = " | ".join(f"`identifier_{i}`" for i in range(8))
    type_and_send(page, f"| {' | '.join(f'c{i}' for i in range(8))} |\n|{'---|' * 8}\n| {row} |")
    wait_for_answer_done(page)
    lines = answer_body(page).locator("td code").evaluate_all("codes => codes.map((c) => c.getClientRects().length)")
    assert lines == [1] * 8


def test_right_to_left_text_gets_its_direction_from_the_text(ui):
    page = ui.page
    type_and_send(page, "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd")
    wait_for_answer_done(page)
    assert page.locator("article.msg-user .msg-body").get_attribute("dir") == "auto"
    assert answer_body(page).get_attribute("dir") == "auto"
    assert page.locator("#chat-title").get_attribute("dir") == "auto"
    assert page.locator("#conversation-list .conv-open").first.get_attribute("dir") == "auto"


def attach_notes(page, tmp_path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("some notes")
    page.set_input_files("#attach-input", str(notes))
    page.locator("#attachments .attachment.uploaded").wait_for()


def test_a_sent_messages_attachments_sit_on_the_right_with_its_bubble(ui, tmp_path):
    page = ui.page
    attach_notes(page, tmp_path)
    type_and_send(page, "Summarize this")
    wait_for_answer_done(page)
    message = page.locator("article.msg-user").last
    chip = message.locator(".msg-attachments .attachment").bounding_box()
    bubble = message.locator(".msg-body").bounding_box()
    assert abs((chip["x"] + chip["width"]) - (bubble["x"] + bubble["width"])) < 4


def test_a_message_with_only_an_attachment_has_no_empty_bubble(ui, tmp_path):
    page = ui.page
    attach_notes(page, tmp_path)
    page.get_by_label("Message", exact=True).press("Enter")
    wait_for_answer_done(page)
    message = page.locator("article.msg-user").last
    assert message.locator(".msg-attachments .attachment").count() == 1
    assert not message.locator(".msg-body").is_visible()
