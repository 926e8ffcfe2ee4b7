"""Background Responses (`background: true`) through the official `openai` SDK, on the fake backend.

Shows: the POST answers `queued` at once and `retrieve` polls it to the stored result, billed once in
the same ledger as a foreground response; the work goes on after the client has gone; `cancel` stops
it (the engine request is aborted, the stream slot freed, the ledger row says aborted); a restart
marks what a previous process left unfinished `failed`; bad combinations are 400s naming the field;
another organisation holding the id gets 404 for every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import openai
import pytest

from store.responses import StoredResponse
from testing.fake_backend import FakeBehaviour
from tests.api.helpers import state_of

TEXT = "the river runs down to the sea and the sea is wide"


async def sdk_for(client, org: str = "acme", tier: str = "enterprise") -> openai.AsyncOpenAI:
    store = state_of(client).store
    if await store.get_org(org) is None:
        await store.create_org(org, tier)
    _, secret = await store.create_key(org)
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=secret, max_retries=0)


async def poll(sdk: openai.AsyncOpenAI, response_id: str, until: tuple[str, ...], timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        response = await sdk.responses.retrieve(response_id)
        if response.status in until or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.02)


async def test_background_answers_queued_at_once_and_retrieve_polls_to_the_result_billed_once(make_client):
    client = await make_client(behaviour=FakeBehaviour(token_delay_s=0.02))
    sdk = await sdk_for(client)
    created = await sdk.responses.create(model="echo", input=TEXT, background=True)
    assert created.status in ("queued", "in_progress") and created.background is True and created.output == []
    done = await poll(sdk, created.id, ("completed", "failed", "cancelled"))
    assert done.status == "completed" and done.output_text == TEXT and done.background is True
    org = (await state_of(client).store.get_org("acme")).id
    (row,) = await state_of(client).store.usage_summary(org, start=0, end=None, group_by="model")
    assert row["num_requests"] == 1 and row["completion_tokens"] == done.usage.output_tokens > 0
    follow = await sdk.responses.create(model="echo", input="and then?", previous_response_id=done.id)
    assert follow.usage.input_tokens > done.usage.input_tokens  # the background turn is in the conversation


async def test_the_work_goes_on_after_the_client_that_asked_has_gone(make_client):
    client = await make_client(behaviour=FakeBehaviour(token_delay_s=0.02))
    first = await sdk_for(client)
    created = await first.responses.create(model="echo", input=TEXT, background=True)
    await first.close()  # its connections are gone; the response is not tied to them
    later = await sdk_for(client)
    done = await poll(later, created.id, ("completed", "failed", "cancelled"))
    assert done.status == "completed" and done.output_text == TEXT


async def test_cancel_aborts_the_engine_request_frees_the_stream_slot_and_bills_what_ran(make_client):
    client = await make_client("tiers.enterprise.max_concurrent_streams=1", behaviour=FakeBehaviour(token_delay_s=0.2))
    backend = state_of(client).models["echo"].backend
    sdk = await sdk_for(client)
    created = await sdk.responses.create(model="echo", input=TEXT, background=True)
    running = await poll(sdk, created.id, ("in_progress",))
    assert running.status == "in_progress"
    with pytest.raises(openai.RateLimitError):  # it holds the tier's one stream while it runs
        await sdk.responses.create(model="echo", input="hi", store=False)
    cancelled = await sdk.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert (await sdk.responses.retrieve(created.id)).status == "cancelled"
    assert backend.aborted  # the engine stopped generating
    after = await sdk.responses.create(model="echo", input="hi", store=False)  # the slot is free again
    assert after.status == "completed"
    again = await sdk.responses.cancel(created.id)  # cancelling a finished one changes nothing
    assert again.status == "cancelled"
    org = (await state_of(client).store.get_org("acme")).id
    rows = await state_of(client).store.usage_summary(org, start=0, end=None, group_by="model")
    assert sum(r["num_requests"] for r in rows) == 2  # the cancelled one is in the ledger once


async def test_only_background_responses_can_be_cancelled(make_client):
    client = await make_client()
    sdk = await sdk_for(client)
    done = await sdk.responses.create(model="echo", input="hello")
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.responses.cancel(done.id)
    assert refused.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.cancel("resp_nope")


async def test_another_organisation_cannot_read_replay_cancel_or_delete_a_response_by_its_id(make_client):
    """Open WebUI's CVE-2026-45349 class: every lookup by response id filters by owner, so a
    stranger holding the id gets the 404 an unknown id gets, and the owner's answer runs on."""
    client = await make_client(behaviour=FakeBehaviour(token_delay_s=0.05))
    owner, stranger = await sdk_for(client), await sdk_for(client, "other")
    created = await owner.responses.create(model="echo", input=TEXT, background=True)
    assert (await poll(owner, created.id, ("in_progress",))).status == "in_progress"
    for attempt in (
        stranger.responses.retrieve(created.id),
        stranger.responses.retrieve(created.id, stream=True),
        stranger.responses.input_items.list(created.id),
        stranger.responses.cancel(created.id),
        stranger.responses.delete(created.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await attempt
    assert not state_of(client).models["echo"].backend.aborted
    done = await poll(owner, created.id, ("completed", "failed", "cancelled"))
    assert done.status == "completed" and done.output_text == TEXT


async def test_a_refusal_before_the_queue_is_the_posts_own_4xx_and_leaves_nothing(make_client):
    client = await make_client()
    sdk = await sdk_for(client)
    with pytest.raises(openai.BadRequestError) as refused:  # the prompt does not fit the context
        await sdk.responses.create(model="echo", input="word " * 2000, background=True)
    assert refused.value.status_code == 400
    listed = await (await client.get("/v1/conversations", headers={"Authorization": f"Bearer {sdk.api_key}"})).json()
    assert listed["data"] == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": "yes"}, "background"),
        ({"background": True, "store": False}, "background"),
        ({"background": True, "stream": True}, "stream"),
    ],
)
async def test_bad_background_combinations_are_400s_naming_the_field(make_client, body, param):
    client = await make_client()
    resp = await client.post("/v1/responses", json={"model": "echo", "input": "x", **body})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param


async def test_a_restart_marks_background_responses_left_unfinished_failed(make_client, tmp_path):
    client = await make_client()
    sdk = await sdk_for(client)
    done = await sdk.responses.create(model="echo", input="hello", background=True)
    done = await poll(sdk, done.id, ("completed",))
    org = (await state_of(client).store.get_org("acme")).id
    body = done.model_dump_json().replace('"completed"', '"in_progress"', 1)
    stored = await state_of(client).store.get_response(org, done.id)
    # What a process killed mid-answer leaves behind: a second row still in progress.
    await state_of(client).store.insert_response(
        org,
        StoredResponse(
            "resp_orphan",
            stored.conversation_id,
            stored.num_messages,
            body.replace(done.id, "resp_orphan"),
            "[]",
            time.time(),
            "in_progress",
        ),
    )
    await client.server.close()
    await client.close()

    client = await make_client(f'store.path="{tmp_path / "chat.db"}"')  # the same database, a new process
    sdk = await sdk_for(client)
    orphan = await sdk.responses.retrieve("resp_orphan")
    assert orphan.status == "failed" and orphan.error.code == "server_error"
    assert (await sdk.responses.retrieve(done.id)).status == "completed"  # finished ones are untouched


async def test_a_shutdown_mid_answer_never_leaves_it_in_progress(make_client, tmp_path):
    client = await make_client(behaviour=FakeBehaviour(token_delay_s=0.2))
    sdk = await sdk_for(client)
    created = await sdk.responses.create(model="echo", input=TEXT, background=True)
    await poll(sdk, created.id, ("in_progress",))
    await client.server.close()
    await client.close()

    client = await make_client(f'store.path="{tmp_path / "chat.db"}"')
    sdk = await sdk_for(client)
    after = await sdk.responses.retrieve(created.id)
    assert after.status == "failed" and after.error is not None


async def test_a_conversation_whose_first_answer_a_crash_cut_is_gone_after_a_restart(make_client, tmp_path):
    """A Responses call creates its conversation before answering; killed mid-answer (kill -9),
    the process left it empty in the list. It is `pending` until its first turn is stored, and a
    start deletes what is still pending; conversations made on purpose, even empty, stay."""
    import sqlite3

    client = await make_client(behaviour=FakeBehaviour(token_delay_s=0.05))
    sdk = await sdk_for(client)
    db = tmp_path / "chat.db"

    def pending_rows() -> list[tuple[str, int]]:
        with sqlite3.connect(db) as conn:
            return conn.execute("SELECT title, pending FROM conversations ORDER BY created_at").fetchall()

    async with await sdk.responses.create(model="echo", input="cut short here", stream=True) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                assert pending_rows() == [("cut short here", 1)]  # mid-answer, as a crash would find it
                break
    await asyncio.sleep(0.1)
    await sdk.responses.create(model="echo", input="answered in full")
    empty = await sdk.conversations.create()  # an empty conversation made on purpose
    rows = dict(pending_rows())
    assert rows["answered in full"] == 0 and rows[None] == 0
    await client.server.close()
    await client.close()
    with sqlite3.connect(db) as conn:  # what a process killed mid-answer leaves behind: no turn, no response row
        cut = "(SELECT id FROM conversations WHERE title = 'cut short here')"
        conn.execute(f"DELETE FROM responses WHERE conversation_id = {cut}")
        conn.execute(f"DELETE FROM messages WHERE conversation_id = {cut}")
        conn.execute("UPDATE conversations SET pending = 1 WHERE title = 'cut short here'")

    client = await make_client(f'store.path="{db}"')  # the same database, a new process
    auth = {"Authorization": f"Bearer {sdk.api_key}"}  # the same organisation (acme)
    listed = await (await client.get("/v1/conversations", headers=auth)).json()
    assert sorted(conv["title"] or "" for conv in listed["data"]) == ["", "answered in full"]
    assert empty.id in {conv["id"] for conv in listed["data"]}
    assert dict(pending_rows()) == {"answered in full": 0, None: 0}


async def test_a_cancel_landing_after_the_answer_was_stored_leaves_it_completed(make_client):
    """The answer is billed and its turn stored, then its row is updated: a cancel between the
    two wrote `cancelled` with no output over a stored, billed answer (seen once in a soak)."""
    client = await make_client()
    sdk = await sdk_for(client)
    store = state_of(client).store
    release, reached = asyncio.Event(), asyncio.Event()
    update_response = store.update_response

    async def held_update(org_id, response_id, **fields):
        if fields.get("status") == "completed":  # the answer is stored: hold its row's last write
            reached.set()
            await release.wait()
        return await update_response(org_id, response_id, **fields)

    store.update_response = held_update
    created = await sdk.responses.create(model="echo", input=TEXT, background=True)
    await asyncio.wait_for(reached.wait(), 10)
    cancel = asyncio.create_task(sdk.responses.cancel(created.id))
    await asyncio.sleep(0.2)  # the cancel reaches the task while its last write is held
    release.set()
    cancelled = await cancel
    assert cancelled.status == "completed" and cancelled.output_text == TEXT
    assert (await sdk.responses.retrieve(created.id)).output_text == TEXT


async def test_a_stream_its_client_left_is_stored_as_cancelled_and_can_be_continued(make_client):
    """Its turn is in the conversation (what was generated, billed as aborted): the response id the
    client saw resolves to it, and previous_response_id continues from it."""
    client = await make_client(behaviour=FakeBehaviour(token_delay_s=0.05))
    sdk = await sdk_for(client)
    async with await sdk.responses.create(model="echo", input=TEXT, stream=True) as stream:
        async for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta":
                break
    for _ in range(100):  # the server learns of the leaving client on its next write
        with contextlib.suppress(openai.NotFoundError):
            stored = await sdk.responses.retrieve(response_id)
            break
        await asyncio.sleep(0.05)
    assert stored.status == "cancelled" and TEXT.startswith(stored.output_text) and stored.output_text
    assert stored.usage.output_tokens >= 1
    follow = await sdk.responses.create(model="echo", input="and then?", previous_response_id=response_id)
    assert follow.status == "completed" and follow.usage.input_tokens > stored.usage.input_tokens


async def test_a_stream_the_engine_cut_ends_with_response_failed_and_is_stored_failed(make_client):
    client = await make_client(behaviour=FakeBehaviour(fail_after=3))
    sdk = await sdk_for(client)
    events = [e async for e in await sdk.responses.create(model="echo", input=TEXT, stream=True)]
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "engine_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    stored = await sdk.responses.retrieve(last.response.id)
    assert stored.status == "failed" and stored.error.code == "engine_error"


async def test_a_cancel_landing_while_the_answer_is_billed_and_stored_leaves_it_completed(make_client):
    """The window before the last: the cancel reaches the task while the ledger row and the turn of
    its complete answer are being written (a race probe hit it once in 110 tries over HTTP)."""
    client = await make_client()
    sdk = await sdk_for(client)
    store = state_of(client).store
    release, reached = asyncio.Event(), asyncio.Event()
    record_request = store.record_request

    async def held_record(record):
        if record.status.value == "finished":  # the whole answer was generated: hold its durable write
            reached.set()
            await release.wait()
        return await record_request(record)

    store.record_request = held_record
    created = await sdk.responses.create(model="echo", input=TEXT, background=True)
    await asyncio.wait_for(reached.wait(), 10)
    cancel = asyncio.create_task(sdk.responses.cancel(created.id))
    await asyncio.sleep(0.2)  # the cancel reaches the task while the write is held
    release.set()
    cancelled = await cancel
    assert cancelled.status == "completed" and cancelled.output_text == TEXT
    assert (await sdk.responses.retrieve(created.id)).output_text == TEXT


async def test_a_stream_whose_client_leaves_while_its_complete_answer_is_recorded_stays_completed(make_client):
    """The answer was billed and its turn stored; the client left during the response row's write:
    the cut's path must not turn it into a `cancelled` one."""
    client = await make_client()
    state = state_of(client)
    release, reached = asyncio.Event(), asyncio.Event()
    insert_response = state.store.insert_response

    async def held_insert(org_id, response):
        reached.set()
        await release.wait()
        return await insert_response(org_id, response)

    state.store.insert_response = held_insert
    resp = await client.post("/v1/responses", json={"model": "echo", "input": TEXT, "stream": True})
    response_id = None
    async for line in resp.content:
        if line.startswith(b"data: ") and b'"response.created"' in line:
            response_id = json.loads(line[6:])["response"]["id"]
            break
    await asyncio.wait_for(reached.wait(), 10)
    resp.close()  # the client leaves while the row is being written
    await asyncio.sleep(0.2)
    release.set()
    org = await state.store.get_org("local")  # a keyless request from this machine
    for _ in range(100):
        stored = await state.store.get_response(org.id, response_id)
        if stored is not None and stored.status != "in_progress":
            break
        await asyncio.sleep(0.05)
    assert stored is not None and stored.status == "completed", stored
    assert json.loads(stored.body_json)["output"][0]["content"][0]["text"] == TEXT
