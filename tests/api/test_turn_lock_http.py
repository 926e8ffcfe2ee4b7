"""One turn at a time per stored conversation (api/turn_lock.py): a second turn, or a cut of the
conversation, waits for the turn in progress, then gets 400 conversation_locked; two Responses
continuing the same latest response make one turn and one branch; every way out releases it."""

from __future__ import annotations

import asyncio

import pytest

from api import turn_lock
from testing.fake_backend import FakeBehaviour
from tests.api.helpers import state_of


async def new_conversation(client) -> str:
    return (await (await client.post("/v1/conversations", json={})).json())["id"]


def turn(cid: str, text: str, **extra) -> dict:
    return {"model": "echo", "conversation_id": cid, "messages": [{"role": "user", "content": text}], **extra}


async def until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def stored(client, cid: str) -> list[tuple[str, str]]:
    conv = await (await client.get(f"/v1/conversations/{cid}")).json()
    return [(m["role"], m["content"]) for m in conv["messages"]]


async def test_a_second_turn_or_a_cut_while_a_turn_streams_is_refused_and_the_conversation_stays_in_order(
    make_client, monkeypatch
):
    monkeypatch.setattr(turn_lock, "WAIT_S", 0.2)
    client = await make_client(behaviour=FakeBehaviour(is_gated=True))
    backend = state_of(client).models["echo"].backend
    cid = await new_conversation(client)
    first = asyncio.create_task(client.post("/v1/chat/completions", json=turn(cid, "river sea", stream=True)))
    await until(lambda: len(backend.requests) == 1)
    second = await client.post("/v1/chat/completions", json=turn(cid, "mountain"))
    assert second.status == 400
    error = (await second.json())["error"]
    assert (error["code"], error["param"]) == ("conversation_locked", "conversation_id")
    cut = await client.post(f"/v1/conversations/{cid}/truncate", json={"keep_messages": 0})
    assert cut.status == 400 and (await cut.json())["error"]["code"] == "conversation_locked"
    assert len(backend.requests) == 1  # neither reached the engine
    backend.release(100)
    resp = await first
    assert resp.status == 200 and (await resp.text()).endswith("data: [DONE]\n\n")
    assert await stored(client, cid) == [("user", "river sea"), ("assistant", "river sea")]
    # Free again: the next turn sees the first one in its history.
    backend.release(100)
    third = await client.post("/v1/chat/completions", json=turn(cid, "mountain"))
    assert third.status == 200
    prompt = backend._tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "river sea" in prompt and "mountain" in prompt
    assert [m[1] for m in await stored(client, cid)] == ["river sea", "river sea", "mountain", "mountain"]


async def test_a_turn_arriving_while_the_last_one_ends_waits_for_it_and_goes_after_it(make_client):
    client = await make_client(behaviour=FakeBehaviour(is_gated=True))
    backend = state_of(client).models["echo"].backend
    cid = await new_conversation(client)
    first = asyncio.create_task(client.post("/v1/chat/completions", json=turn(cid, "river sea")))
    await until(lambda: len(backend.requests) == 1)
    second = asyncio.create_task(client.post("/v1/chat/completions", json=turn(cid, "mountain")))
    await asyncio.sleep(0.1)
    assert len(backend.requests) == 1  # waiting for the first turn, not reading the history yet
    backend.release(1000)
    assert (await first).status == 200 and (await second).status == 200
    prompt = backend._tokenizer.decode(backend.requests[1].prompt_token_ids, skip_special_tokens=False)
    assert "river sea" in prompt  # the second turn's history holds the first's answer
    assert [m[1] for m in await stored(client, cid)] == ["river sea", "river sea", "mountain", "mountain"]


@pytest.mark.parametrize("way_out", ["unknown model", "client left"])
async def test_every_way_out_of_a_turn_frees_its_conversation(make_client, monkeypatch, way_out):
    client = await make_client(behaviour=FakeBehaviour(is_gated=way_out == "client left"))
    backend = state_of(client).models["echo"].backend
    cid = await new_conversation(client)
    if way_out == "unknown model":
        resp = await client.post("/v1/chat/completions", json={**turn(cid, "river"), "model": "nope"})
        assert resp.status == 404
    else:
        resp = await client.post("/v1/chat/completions", json=turn(cid, "river", stream=True))
        backend.release(1)
        await resp.content.readline()  # the first chunk: the turn runs
        resp.close()  # the client leaves mid-answer
        org_id = state_of(client).local_principal.org.id
        assert state_of(client).turn_locks.is_held(org_id, cid)
        await until(lambda: not state_of(client).turn_locks.is_held(org_id, cid))
        backend.release(1000)
    monkeypatch.setattr(turn_lock, "WAIT_S", 0.0)
    assert (await client.post("/v1/chat/completions", json=turn(cid, "sea"))).status == 200


async def test_two_responses_continuing_the_same_latest_response_make_one_turn_and_one_branch(make_client):
    client = await make_client()
    backend = state_of(client).models["echo"].backend
    r1 = await (await client.post("/v1/responses", json={"model": "echo", "input": "river"})).json()
    backend.behaviour = FakeBehaviour(is_gated=True)  # the two continuations wait for release()
    base = len(backend.requests)

    def follow(text: str):
        body = {"model": "echo", "input": text, "previous_response_id": r1["id"]}
        return asyncio.create_task(client.post("/v1/responses", json=body))

    a = follow("sea")
    await until(lambda: len(backend.requests) == base + 1)
    b = follow("mountain")
    await asyncio.sleep(0.1)
    backend.release(1000)
    ra, rb = await (await a).json(), await (await b).json()
    assert ra["status"] == rb["status"] == "completed"
    # b was decided once a's turn was stored: r1 was no longer the latest, so b branched.
    prompt_b = backend._tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "river" in prompt_b and "sea" not in prompt_b
    store, org_id = state_of(client).store, state_of(client).local_principal.org.id
    conv1 = (await store.get_response(org_id, r1["id"])).conversation_id
    conv_a = (await store.get_response(org_id, ra["id"])).conversation_id
    conv_b = (await store.get_response(org_id, rb["id"])).conversation_id
    assert conv_a == conv1 != conv_b
    assert [m[1] for m in await stored(client, conv1)] == ["river", "river", "sea", "sea"]
    assert [m[1] for m in await stored(client, conv_b)] == ["river", "river", "mountain", "mountain"]


async def test_a_cut_that_waited_for_a_turn_cuts_nothing_that_turn_stored_when_it_names_the_last_message(
    make_client,
):
    client = await make_client(behaviour=FakeBehaviour(is_gated=True))
    backend = state_of(client).models["echo"].backend
    cid = await new_conversation(client)
    backend.release(1000)
    assert (await client.post("/v1/chat/completions", json=turn(cid, "one"))).status == 200
    seen = (await (await client.get(f"/v1/conversations/{cid}")).json())["messages"]  # a tab's view: 2 messages
    backend.behaviour = FakeBehaviour(is_gated=True)
    other_tab = asyncio.create_task(client.post("/v1/chat/completions", json=turn(cid, "two")))
    await until(lambda: len(backend.requests) == 2)
    body = {"keep_messages": 1, "expected_last_message_id": seen[-1]["id"]}  # regenerate "one"'s answer
    cut = asyncio.create_task(client.post(f"/v1/conversations/{cid}/truncate", json=body))
    await asyncio.sleep(0.1)
    backend.release(1000)  # the other tab's turn ends and is stored while the cut waits
    assert (await other_tab).status == 200
    resp = await cut
    assert resp.status == 409
    assert (await resp.json())["error"]["code"] == "conversation_changed"
    assert [m[1] for m in await stored(client, cid)] == ["one", "one", "two", "two"]  # nothing cut
    latest = (await (await client.get(f"/v1/conversations/{cid}")).json())["messages"][-1]["id"]
    body = {"keep_messages": 1, "expected_last_message_id": latest}
    assert (await client.post(f"/v1/conversations/{cid}/truncate", json=body)).status == 200
    assert await stored(client, cid) == [("user", "one")]


async def test_continuing_an_older_response_while_a_turn_runs_branches_at_once(make_client, monkeypatch):
    monkeypatch.setattr(turn_lock, "WAIT_S", 30.0)  # a wait would show as a timeout below
    client = await make_client()
    backend = state_of(client).models["echo"].backend
    r1 = await (await client.post("/v1/responses", json={"model": "echo", "input": "river"})).json()
    body = {"model": "echo", "input": "sea", "previous_response_id": r1["id"]}
    r2 = await (await client.post("/v1/responses", json=body)).json()
    backend.behaviour = FakeBehaviour(is_gated=True)
    running = asyncio.create_task(
        client.post("/v1/responses", json={**body, "input": "lake", "previous_response_id": r2["id"]})
    )
    await until(lambda: len(backend.requests) == 3)
    older = asyncio.create_task(
        client.post("/v1/responses", json={**body, "input": "hill", "previous_response_id": r1["id"]})
    )
    await until(lambda: len(backend.requests) == 4, timeout_s=2.0)  # not waiting for the running turn
    backend.release(1000)
    assert (await running).status == 200
    assert (await (await older).json())["status"] == "completed"


async def test_a_cuts_feedback_note_is_recorded_only_with_the_cut(make_client):
    client = await make_client()
    cid = await new_conversation(client)
    assert (await client.post("/v1/chat/completions", json=turn(cid, "one"))).status == 200
    messages = (await (await client.get(f"/v1/conversations/{cid}")).json())["messages"]
    note = {"message_id": messages[1]["id"], "edited_prompt": "uno"}
    refused = {"keep_messages": 0, "expected_last_message_id": "msg_not_the_last", "feedback": note}
    assert (await client.post(f"/v1/conversations/{cid}/truncate", json=refused)).status == 409
    store = state_of(client).store
    assert await store.conversation_feedback(cid) == {}  # no edit happened: none recorded
    bad = {"keep_messages": 0, "feedback": {"edited_prompt": "uno"}}
    resp = await client.post(f"/v1/conversations/{cid}/truncate", json=bad)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "feedback"
    made = {"keep_messages": 0, "expected_last_message_id": messages[1]["id"], "feedback": note}
    assert (await client.post(f"/v1/conversations/{cid}/truncate", json=made)).status == 200
    (saved,) = (await store.conversation_feedback(cid)).values()
    assert (saved.prompt, saved.answer, saved.edited_prompt) == ("one", "one", "uno")
    assert await stored(client, cid) == []
