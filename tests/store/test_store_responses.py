"""Stored responses and the conversations the Responses and Conversations APIs make: a background
response moves queued -> in_progress -> final, once; a start marks what a previous process left
unfinished as failed, in the row and in its body; a branch copies the first messages of a
conversation into a new one; a conversation keeps its metadata (migration 10) and its first items."""

from __future__ import annotations

import json
import sqlite3
import time

from store.responses import StoredResponse
from store.store import Store
from store.types import Message
from tests.store.schema_helpers import drop_created_index, drop_search_index, drop_shares


async def _queued(store, org_id: str, response_id: str) -> None:
    conv = await store.create_conversation(org_id, title="t")
    body = json.dumps({"id": response_id, "status": "queued", "error": None})
    await store.insert_response(org_id, StoredResponse(response_id, conv.id, 0, body, "[]", time.time(), "queued"))


async def test_a_background_response_reaches_one_final_state_and_keeps_it(store):
    org = await store.ensure_org("acme", "free")
    await _queued(store, org.id, "resp_a")
    assert await store.update_response(org.id, "resp_a", status="in_progress", body_json='{"status": "in_progress"}')
    assert await store.update_response(
        org.id, "resp_a", status="completed", body_json='{"status": "completed"}', num_messages=2
    )
    # A late cancel (or a second writer) finds it final and changes nothing.
    assert not await store.update_response(org.id, "resp_a", status="cancelled", body_json='{"status": "cancelled"}')
    stored = await store.get_response(org.id, "resp_a")
    assert (stored.status, json.loads(stored.body_json)["status"], stored.num_messages) == ("completed", "completed", 2)


async def test_a_start_marks_only_unfinished_responses_failed_with_the_error_in_their_body(store):
    org = await store.ensure_org("acme", "free")
    await _queued(store, org.id, "resp_left")
    await _queued(store, org.id, "resp_done")
    await store.update_response(org.id, "resp_done", status="completed", body_json='{"status": "completed"}')
    assert await store.fail_unfinished_responses({"code": "server_error", "message": "restarted"}) == 1
    left = await store.get_response(org.id, "resp_left")
    body = json.loads(left.body_json)
    assert left.status == "failed" and body["status"] == "failed" and body["error"]["code"] == "server_error"
    assert body["id"] == "resp_left"  # the rest of the object is kept
    assert (await store.get_response(org.id, "resp_done")).status == "completed"
    assert await store.fail_unfinished_responses({"code": "server_error", "message": "again"}) == 0


def _message(seq: int) -> Message:
    return Message(f"msg_{seq}", "user" if seq % 2 == 0 else "assistant", f"text {seq}", time.time() + seq)


async def test_a_branch_copies_the_first_messages_into_a_new_pending_conversation(store):
    org = await store.ensure_org("acme", "free")
    source = await store.create_conversation(org.id, title="rivers", messages=tuple(_message(i) for i in range(4)))
    branch = await store.branch_conversation(org.id, source.id, 2, pending=True)
    copied = await store.get_conversation(org.id, branch.id)
    assert branch.id != source.id and copied.title == "rivers"
    assert [m.content for m in copied.messages] == ["text 0", "text 1"]
    assert {m.id for m in copied.messages}.isdisjoint({"msg_0", "msg_1"})  # new ids: feedback stays with the source
    assert len((await store.get_conversation(org.id, source.id)).messages) == 4  # untouched
    assert await store.delete_pending_conversations() == 1  # pending until its first turn is stored
    assert await store.branch_conversation(org.id, source.id, 5) is None  # shorter than asked
    await store.delete_conversation(org.id, source.id)
    assert await store.branch_conversation(org.id, source.id, 2) is None  # gone
    other = await store.ensure_org("other", "free")
    assert await store.branch_conversation(other.id, source.id, 2) is None


async def test_a_branch_through_a_named_message_is_not_made_once_that_message_was_cut(store, make_record):
    """The web UI's branch names its last message: a conversation cut and written again between
    the read and the copy has other messages at that place, and is not copied."""
    org = await store.ensure_org("acme", "free")
    source = await store.create_conversation(org.id, title="rivers", messages=tuple(_message(i) for i in range(4)))
    named = await store.branch_conversation(org.id, source.id, 2, title="mine", last_message_id="msg_1")
    assert named is not None and named.title == "mine"
    assert await store.truncate_conversation(org.id, source.id, 1)
    await store.record_request(make_record(org.id, conversation_id=source.id, new_messages=(("user", "other"),)))
    assert await store.branch_conversation(org.id, source.id, 2, last_message_id="msg_1") is None
    second = (await store.get_conversation(org.id, source.id)).messages[1]
    assert second.content == "other"
    assert await store.branch_conversation(org.id, source.id, 2, last_message_id=second.id) is not None


async def test_conversations_made_before_metadata_existed_have_none_after_the_upgrade(db_path, store_config):
    store = await Store.open(db_path, store_config)
    org = await store.ensure_org("acme", "free")
    old = await store.create_conversation(org.id, title="old")
    await store.close()
    with sqlite3.connect(db_path) as conn:  # the file as schema 9 left it
        conn.execute("ALTER TABLE conversations DROP COLUMN metadata_json")
        conn.execute("ALTER TABLE usage DROP COLUMN reasoning_tokens")  # schema 11
        conn.execute("ALTER TABLE usage DROP COLUMN fallback_reason")  # schema 12
        conn.execute("ALTER TABLE usage DROP COLUMN history_messages_dropped")
        drop_shares(conn)  # schema 15
        drop_created_index(conn)  # schema 14
        drop_search_index(conn)  # schema 13
        conn.execute("PRAGMA user_version = 9")

    store = await Store.open(db_path, store_config)
    try:
        assert (await store.get_conversation(org.id, old.id)).metadata == {}
        made = await store.create_conversation(org.id, metadata={"topic": "rivers"}, messages=(_message(0),))
        assert made.title == "text 0" and [m.content for m in made.messages] == ["text 0"]
        page, _ = await store.list_conversations(org.id)
        assert {c.id: c.metadata for c in page} == {made.id: {"topic": "rivers"}, old.id: {}}
    finally:
        await store.close()
