"""POST /v1/conversations/{id}/branch: a copy up to and including one message, the original left
as it is; its answers keep their model and usage; bad input, another organisation's conversation
and the storage cap refused before anything is written."""

from __future__ import annotations

from api.state import AppState
from tests.api.helpers import assert_error, org_headers


async def _chat_twice(client) -> dict:
    """A conversation of two echoed turns: [user, assistant, user, assistant]."""
    cid = (await (await client.post("/v1/conversations", json={"title": "Rivers"})).json())["id"]
    for text in ("Tell me about the Nile", "And the Danube?"):
        body = {"model": "echo", "messages": [{"role": "user", "content": text}], "conversation_id": cid}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
    return await (await client.get(f"/v1/conversations/{cid}")).json()


async def test_a_branch_copies_the_messages_through_the_one_named_and_leaves_the_source(make_client):
    client = await make_client()
    source = await _chat_twice(client)
    first_answer = source["messages"][1]
    resp = await client.post(f"/v1/conversations/{source['id']}/branch", json={"message_id": first_answer["id"]})
    assert resp.status == 200, await resp.text()
    branch = await resp.json()

    assert branch["id"] != source["id"] and branch["title"] == "Branch \u00b7 Rivers"
    assert [(m["role"], m["content"]) for m in branch["messages"]] == [
        (m["role"], m["content"]) for m in source["messages"][:2]
    ]
    assert {m["id"] for m in branch["messages"]}.isdisjoint(m["id"] for m in source["messages"])
    assert branch["messages"][1].get("model") == first_answer.get("model")
    assert branch["messages"][1].get("usage") == first_answer.get("usage")
    assert await (await client.get(f"/v1/conversations/{source['id']}")).json() == source  # untouched
    listed = [c["id"] for c in (await (await client.get("/v1/conversations")).json())["data"]]
    assert listed[0] == branch["id"] and source["id"] in listed

    # the branch goes on its own way
    body = {
        "model": "echo",
        "messages": [{"role": "user", "content": "And the Amazon?"}],
        "conversation_id": branch["id"],
    }
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    after = await (await client.get(f"/v1/conversations/{branch['id']}")).json()
    assert [m["content"] for m in after["messages"]][2] == "And the Amazon?"
    assert len((await (await client.get(f"/v1/conversations/{source['id']}")).json())["messages"]) == 4


async def test_a_branch_takes_its_own_title_and_refuses_bad_input_naming_the_field(make_client):
    client = await make_client()
    source = await _chat_twice(client)
    cid, last = source["id"], source["messages"][-1]["id"]
    named = await client.post(f"/v1/conversations/{cid}/branch", json={"message_id": last, "title": "  Danube  "})
    assert (await named.json())["title"] == "Danube"
    for body, param in (
        ({}, "message_id"),
        ({"message_id": 3}, "message_id"),
        ({"message_id": "msg_nope"}, "message_id"),
        ({"message_id": last, "title": ""}, "title"),
        ({"message_id": last, "title": "x" * 201}, "title"),
        ({"message_id": last, "keep_messages": 2}, "keep_messages"),  # unknown, as creating a conversation says
    ):
        await assert_error(await client.post(f"/v1/conversations/{cid}/branch", json=body), 400, param=param)
    await assert_error(await client.post(f"/v1/conversations/{cid}/branch", json=[1]), 400)
    missing = await client.post("/v1/conversations/conv_nope/branch", json={"message_id": last})
    await assert_error(missing, 404, param="conversation_id")
    assert len((await (await client.get("/v1/conversations")).json())["data"]) == 2  # the source and "Danube"


async def test_another_organisation_cannot_branch_a_conversation_and_the_storage_cap_holds(make_client):
    client = await make_client("tiers.free.conversation_storage_bytes=1000")
    source = await _chat_twice(client)
    other = await org_headers(client, "other", "free")
    body = {"message_id": source["messages"][0]["id"]}
    await assert_error(await client.post(f"/v1/conversations/{source['id']}/branch", json=body, headers=other), 404)
    assert (await (await client.get("/v1/conversations", headers=other)).json())["data"] == []

    items = [{"role": "user", "content": "x" * 990}]
    resp = await client.post("/v1/conversations", json={"items": items}, headers=other)
    assert resp.status == 201
    full = await client.post(
        f"/v1/conversations/{(await resp.json())['id']}/branch",
        json={"message_id": (await resp.json())["messages"][0]["id"]},
        headers=other,
    )
    await assert_error(full, 400, code="conversation_quota_exceeded")
    assert len((await (await client.get("/v1/conversations", headers=other)).json())["data"]) == 1


async def test_a_branch_that_finds_its_source_gone_counts_nothing_against_the_storage_cap(make_client, monkeypatch):
    """The copy's characters were counted against the cap before the copy was made; a source deleted
    in between made a 404 that left them counted, refusing what still fit until the next read."""
    client = await make_client("tiers.enterprise.conversation_storage_bytes=1000")
    items = [{"role": "user", "content": "x" * 400}]
    source = await (await client.post("/v1/conversations", json={"items": items})).json()
    check = AppState.check_conversation_storage

    async def deleted_first(self, principal, adding=0):
        monkeypatch.setattr(AppState, "check_conversation_storage", check)
        assert (await client.delete(f"/v1/conversations/{source['id']}")).status == 200  # another tab's delete
        await check(self, principal, adding)

    monkeypatch.setattr(AppState, "check_conversation_storage", deleted_first)
    body = {"message_id": source["messages"][0]["id"]}
    await assert_error(await client.post(f"/v1/conversations/{source['id']}/branch", json=body), 404)
    fits = [{"role": "user", "content": "y" * 700}]  # the deleted source holds nothing now
    resp = await client.post("/v1/conversations", json={"items": fits})
    assert resp.status == 201, await resp.text()
