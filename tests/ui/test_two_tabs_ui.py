"""Two tabs on one conversation (api/turn_lock.py, the truncate's expected_last_message_id): a
regenerate in one tab while the other streams an answer never deletes that answer; the tab that
was behind is reloaded and says so."""

from __future__ import annotations

from tests.ui.helpers import conversation_id, last_answer, open_page, type_and_send, wait_for_answer_done, wait_until


def test_a_regenerate_in_a_tab_that_is_behind_keeps_the_other_tabs_answer(browser, ui, ui_server):
    a = ui.page
    type_and_send(a, "hello")
    wait_for_answer_done(a)
    cid = conversation_id(a)
    b = open_page(browser, ui_server.base_url, path=f"/#{cid}")
    b.page.locator("article.msg").nth(1).wait_for()
    medium = " ".join("w" for _ in range(25))  # the fake answers it word by word, for about 2 s
    type_and_send(a, medium)
    wait_until(lambda: len(last_answer(a).locator(".msg-body").inner_text()) > 5)
    # Tab B still shows only the first turn: its regenerate waits for A's turn, then finds it stored.
    b.page.get_by_role("button", name="Regenerate the answer").click()
    wait_for_answer_done(a)
    wait_for_answer_done(b.page, 30)
    _, stored = ui_server.get_json(f"/v1/conversations/{cid}")
    assert [m["content"] for m in stored["messages"]] == ["hello", "hello", medium, medium]
    wait_until(lambda: "changed in another tab" in b.page.locator("#banner").inner_text())
    wait_until(lambda: b.page.locator("article.msg").count() == 4)  # reloaded: A's turn is shown
    b.close()
