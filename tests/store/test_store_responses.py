"""Stored responses' status: a background response moves queued -> in_progress -> final, once;
a start marks what a previous process left unfinished as failed, in the row and in its body."""

from __future__ import annotations

import json
import time

from store.responses import StoredResponse


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
