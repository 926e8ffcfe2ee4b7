"""Moving between chats in the browser: Stop while a new chat is being created, deleting the
open chat (here or in another tab), a stale tab's Regenerate (also while the other tab's answer
streams), Back and Forward, switching while an answer streams, a link to an unknown chat and the
browser tab's title."""

from __future__ import annotations

import urllib.request

import pytest
from playwright.sync_api import expect

from tests.ui.helpers import (
    conversation_id,
    last_answer,
    open_page,
    type_and_send,
    wait_for_answer_done,
    wait_until,
)

pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(f"word{i}" for i in range(400))  # several hundred tokens: ~20 s at 0.05 s each


def delete_on_server(server, cid: str) -> None:
    request = urllib.request.Request(f"{server.base_url}/v1/conversations/{cid}", method="DELETE")
    urllib.request.urlopen(request, timeout=10).read()


def stored_messages(server, cid: str) -> list[dict]:
    status, stored = server.get_json(f"/v1/conversations/{cid}")
    return stored["messages"] if status == 200 else []


def start_long_answer(page) -> None:
    type_and_send(page, LONG_TEXT)
    wait_until(lambda: len(last_answer(page).locator(".msg-body").inner_text()) > 20)


def user_texts(page) -> list[str]:
    return page.locator("article.msg-user .msg-body").all_inner_texts()


def test_stop_while_a_new_chat_is_created_gives_the_text_back_and_deletes_the_chat(ui, ui_server):
    page = ui.page
    held = []
    # The creating POST waits until the test lets it go, as on a slow network.
    page.route("**/v1/conversations", lambda r: held.append(r) if r.request.method == "POST" else r.continue_())
    type_and_send(page, "Never mind this one")
    wait_until(lambda: page.wait_for_timeout(50) or held)  # Playwright runs the route handler while it waits
    with page.expect_request(lambda r: r.method == "DELETE") as deletion:
        page.get_by_role("button", name="Stop").click()
        held[0].continue_()
    wait_for_answer_done(page)
    expect(page.get_by_label("Message", exact=True)).to_have_value("Never mind this one")
    cid = deletion.value.url.rsplit("/", 1)[1]
    assert cid.startswith("conv_")
    wait_until(lambda: ui_server.get_json(f"/v1/conversations/{cid}")[0] == 404)
    assert page.locator(f'#conversation-list li[data-id="{cid}"]').count() == 0
    assert conversation_id(page) == "" and page.locator("article.msg").count() == 0
    assert not ui.page_errors


def test_deleting_the_open_chat_while_it_answers_stops_and_moves_to_a_new_chat(ui, ui_server):
    page = ui.page
    start_long_answer(page)
    cid = conversation_id(page)
    item = page.locator(f'#conversation-list li[data-id="{cid}"]')
    item.hover()
    item.locator(".conv-delete").click()
    page.locator("#confirm-dialog").get_by_role("button", name="Delete").click()
    expect(page.locator("#chat-title")).to_have_text("New chat")
    wait_for_answer_done(page)
    assert conversation_id(page) == "" and page.locator("article.msg").count() == 0
    wait_until(lambda: ui_server.get_json(f"/v1/conversations/{cid}")[0] == 404)
    assert not ui.page_errors


def test_sending_into_a_chat_deleted_elsewhere_starts_a_new_chat_with_the_text_kept(ui, ui_server):
    page = ui.page
    type_and_send(page, "first turn")
    wait_for_answer_done(page)
    cid = conversation_id(page)
    delete_on_server(ui_server, cid)  # as from another tab
    type_and_send(page, "second turn")
    banner = page.get_by_role("alert")
    expect(banner).to_contain_text("deleted")
    wait_for_answer_done(page)
    expect(page.get_by_label("Message", exact=True)).to_have_value("second turn")
    assert conversation_id(page) == "" and page.locator("article.msg").count() == 0
    assert page.locator("#chat-title").inner_text() == "New chat"


def test_regenerate_in_a_stale_tab_reloads_instead_of_deleting_the_other_tabs_turns(ui, browser, ui_server):
    page = ui.page
    type_and_send(page, "from tab A")
    wait_for_answer_done(page)
    cid = conversation_id(page)
    other = open_page(browser, ui_server.base_url, path=f"/#{cid}")
    try:
        type_and_send(other.page, "from tab B")
        wait_for_answer_done(other.page)
    finally:
        other.close()
    page.get_by_role("button", name="Regenerate the answer").click()
    expect(page.get_by_role("alert")).to_contain_text("changed in another tab")
    wait_for_answer_done(page)
    assert [m["content"] for m in stored_messages(ui_server, cid) if m["role"] == "user"] == [
        "from tab A",
        "from tab B",
    ]
    assert user_texts(page) == ["from tab A", "from tab B"]


def test_regenerate_in_a_tab_behind_an_answer_still_streaming_keeps_that_answer(ui, browser, ui_server):
    # Tab B's view matches what is stored while tab A's answer streams: its cut waits for A's turn
    # (api/turn_lock.py), finds it stored (expected_last_message_id), cuts nothing and reloads.
    page = ui.page
    type_and_send(page, "hello")
    wait_for_answer_done(page)
    cid = conversation_id(page)
    other = open_page(browser, ui_server.base_url, path=f"/#{cid}")
    try:
        other.page.locator("article.msg").nth(1).wait_for()
        streaming = " ".join("w" for _ in range(25))  # the fake answers it word by word, for about 2 s
        type_and_send(page, streaming)
        wait_until(lambda: len(last_answer(page).locator(".msg-body").inner_text()) > 5)
        other.page.get_by_role("button", name="Regenerate the answer").click()
        wait_for_answer_done(page)
        expect(other.page.get_by_role("alert")).to_contain_text("changed in another tab")
        wait_for_answer_done(other.page, 30)
        assert [m["content"] for m in stored_messages(ui_server, cid)] == ["hello", "hello", streaming, streaming]
        assert user_texts(other.page) == ["hello", streaming]  # reloaded: A's turn is shown
    finally:
        other.close()


def test_back_returns_to_the_chat_opened_before(ui):
    page = ui.page
    type_and_send(page, "chat alpha")
    wait_for_answer_done(page)
    alpha = conversation_id(page)
    page.get_by_role("button", name="New chat").click()
    type_and_send(page, "chat beta")
    wait_for_answer_done(page)
    beta = conversation_id(page)
    page.locator(f'#conversation-list li[data-id="{alpha}"] .conv-open').click()
    wait_until(lambda: user_texts(page) == ["chat alpha"])
    page.go_back()
    wait_until(lambda: user_texts(page) == ["chat beta"])
    assert conversation_id(page) == beta
    page.go_forward()
    wait_until(lambda: user_texts(page) == ["chat alpha"])
    assert conversation_id(page) == alpha


def test_opening_another_chat_while_an_answer_streams_switches_and_stores_the_answer_as_stopped(ui, ui_server):
    page = ui.page
    type_and_send(page, "the other chat")
    wait_for_answer_done(page)
    other = conversation_id(page)
    page.get_by_role("button", name="New chat").click()
    start_long_answer(page)
    streaming = conversation_id(page)
    page.locator(f'#conversation-list li[data-id="{other}"] .conv-open').click()
    wait_until(lambda: user_texts(page) == ["the other chat"])
    assert conversation_id(page) == other
    wait_for_answer_done(page)
    answer = wait_until(lambda: [m for m in stored_messages(ui_server, streaming) if m["role"] == "assistant"])
    assert answer[0]["finish_reason"] == "abort"
    assert user_texts(page) == ["the other chat"]  # the stopped stream does not repaint over it
    assert not ui.page_errors


def test_an_address_change_while_an_answer_streams_shows_the_chat_it_names(ui):
    page = ui.page
    type_and_send(page, "named by the address")
    wait_for_answer_done(page)
    named = conversation_id(page)
    page.get_by_role("button", name="New chat").click()
    start_long_answer(page)
    page.evaluate("(id) => { window.location.hash = id; }", named)
    wait_until(lambda: user_texts(page) == ["named by the address"])
    wait_for_answer_done(page)
    assert conversation_id(page) == named and user_texts(page) == ["named by the address"]


def test_a_link_to_an_unknown_chat_says_it_was_not_found(browser, ui_server):
    watched = open_page(browser, ui_server.base_url, path="/#conv_doesnotexist")
    try:
        page = watched.page
        banner = page.get_by_role("alert")
        expect(banner).to_contain_text("That conversation was not found")
        page.wait_for_timeout(500)  # nothing later takes it away
        assert banner.is_visible() and page.locator("#chat-title").inner_text() == "New chat"
    finally:
        watched.close()


def test_the_browser_tab_shows_the_chats_title(ui):
    page = ui.page
    assert page.title() == "Chat"
    type_and_send(page, "Plans for the weekend")
    wait_for_answer_done(page)
    assert page.title().startswith("Plans for the weekend")
    page.get_by_role("button", name="New chat").click()
    assert page.title() == "Chat"


def test_branch_opens_a_new_chat_up_to_that_answer_and_back_returns_to_the_original(ui, ui_server):
    page = ui.page
    type_and_send(page, "first question")
    wait_for_answer_done(page)
    type_and_send(page, "second question")
    wait_for_answer_done(page)
    source = conversation_id(page)
    wait_until(lambda: len(stored_messages(ui_server, source)) == 4)
    first_answer = page.locator("article.msg-assistant").first
    first_answer.get_by_role("button", name="Branch from message 2").click()
    wait_until(lambda: conversation_id(page) != source and user_texts(page) == ["first question"])
    branch = conversation_id(page)
    assert stored_messages(ui_server, branch)[0]["content"] == "first question"
    assert len(stored_messages(ui_server, branch)) == 2 and len(stored_messages(ui_server, source)) == 4
    expect(page.locator(f'#conversation-list li[data-id="{branch}"] .conv-open')).to_have_text(
        "Branch \u00b7 first question"
    )
    expect(page.locator("#chat-title")).to_have_text("Branch \u00b7 first question")
    expect(page.get_by_label("Message", exact=True)).to_be_focused()
    type_and_send(page, "another way")
    wait_for_answer_done(page)
    assert user_texts(page) == ["first question", "another way"]
    page.go_back()
    wait_until(lambda: user_texts(page) == ["first question", "second question"])
    assert conversation_id(page) == source
