"""The Responses and Conversations APIs as OpenAI's clients expect them, through the official `openai`
SDK on the fake backend (it echoes the last user message, so every prompt is known).

Shows: `instructions` apply to their own request only, first in the prompt; `previous_response_id`
continues from any stored response (a copy of its conversation when it is not the latest); input
items in OpenAI's shape; a conversation created with `items` and `metadata`; a stored response
replayed as its stream; the temperature and top_p actually sampled; OpenAI's newer fields accepted;
a context overflow naming `input`.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time

import openai
import pytest

from api.app import init
from api.responses_stream import replay
from store.responses import StoredResponse
from testing.fake_backend import FakeBehaviour, fake_backends
from tests.api.helpers import echo_settings, state_of


async def sdk_for(client, org: str = "acme") -> openai.AsyncOpenAI:
    store = state_of(client).store
    if await store.get_org(org) is None:
        await store.create_org(org, "enterprise")
    _, secret = await store.create_key(org)
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=secret, max_retries=0)


async def chain(sdk: openai.AsyncOpenAI, *turns: tuple[str, str | None]):
    """One response per (input, instructions), each continuing the one before."""
    previous = None
    for text, instructions in turns:
        previous = await sdk.responses.create(
            model="echo",
            input=text,
            instructions=instructions or openai.omit,
            previous_response_id=previous.id if previous else openai.omit,
        )
    return previous


async def conversation_of(client, sdk: openai.AsyncOpenAI, response_id: str) -> dict:
    org = await state_of(client).store.get_org("acme")
    stored = await state_of(client).store.get_response(org.id, response_id)
    auth = {"Authorization": f"Bearer {sdk.api_key}"}
    return await (await client.get(f"/v1/conversations/{stored.conversation_id}", headers=auth)).json()


async def test_instructions_apply_to_their_own_request_only_and_come_first(make_client):
    client = await make_client()
    sdk = await sdk_for(client)
    backend = state_of(client).models["echo"].backend
    brief = "Be brief."
    every = await chain(sdk, ("rivers", brief), ("and lakes", brief), ("and the sea", brief))
    only_last = await chain(sdk, ("rivers", None), ("and lakes", None), ("and the sea", brief))
    assert every.usage.input_tokens == only_last.usage.input_tokens  # none piled up from earlier turns
    roles = [m["role"] for m in backend.requests[-1].chat.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    swapped = await sdk.responses.create(
        model="echo", input="and the sea", instructions="Answer in French.", previous_response_id=every.id
    )
    prompt = backend.requests[-1].chat.messages
    assert [m["content"] for m in prompt if m["role"] == "system"] == ["Answer in French."]  # replaced, not added
    assert swapped.instructions == "Answer in French."
    stored = await conversation_of(client, sdk, swapped.id)
    assert "system" not in [m["role"] for m in stored["messages"]]  # never part of the conversation's turns


async def test_a_response_continues_from_any_earlier_one_in_a_copy_of_its_conversation(make_client):
    client = await make_client()
    sdk = await sdk_for(client)
    first = await sdk.responses.create(model="echo", input="one")
    second = await sdk.responses.create(model="echo", input="two", previous_response_id=first.id)
    # The SDK's retry of a request that succeeded the first time: the same turn from `first` again.
    retried = await sdk.responses.create(model="echo", input="two", previous_response_id=first.id)
    assert retried.usage.input_tokens == second.usage.input_tokens and retried.output_text == "two"
    original = await conversation_of(client, sdk, second.id)
    branch = await conversation_of(client, sdk, retried.id)
    assert branch["id"] != original["id"]
    assert [m["content"] for m in original["messages"]] == ["one", "one", "two", "two"]  # untouched
    assert [m["content"] for m in branch["messages"]] == ["one", "one", "two", "two"]
    assert {m["id"] for m in branch["messages"]}.isdisjoint(m["id"] for m in original["messages"])
    latest = await sdk.responses.create(model="echo", input="three", previous_response_id=retried.id)
    assert (await conversation_of(client, sdk, latest.id))["id"] == branch["id"]  # the branch's latest: no copy
    await sdk.responses.delete(second.id)
    after_delete = await sdk.responses.create(model="echo", input="four", previous_response_id=first.id)
    assert [m["content"] for m in (await conversation_of(client, sdk, after_delete.id))["messages"]] == [
        "one",
        "one",
        "four",
        "four",
    ]
    unstored = await sdk.responses.create(model="echo", input="two", previous_response_id=first.id, store=False)
    assert unstored.usage.input_tokens == second.usage.input_tokens
    auth = {"Authorization": f"Bearer {sdk.api_key}"}
    listed = await (await client.get("/v1/conversations", headers=auth)).json()
    assert len(listed["data"]) == 3  # the first, the retry's copy, the copy after the delete
    with pytest.raises(openai.NotFoundError):  # refused after its copy was made: the copy goes at once
        await sdk.responses.create(model="nope", input="two", previous_response_id=first.id)
    db = state_of(client).store.path
    with sqlite3.connect(db) as conn:  # not soft-deleted and kept for the retention period
        assert conn.execute("SELECT count(*) FROM conversations").fetchone()[0] == 3


async def test_input_items_are_listed_in_openais_shape(make_client):
    client = await make_client()
    sdk = await sdk_for(client)
    items = [
        {"role": "user", "content": "What is water?"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Wet."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And fire?"}]},
    ]
    response = await sdk.responses.create(model="echo", input=items)
    listed = (await sdk.responses.input_items.list(response.id, order="asc")).data
    assert [(i.role, i.content[0].type, i.content[0].text) for i in listed] == [
        ("user", "input_text", "What is water?"),
        ("assistant", "output_text", "Wet."),
        ("user", "input_text", "And fire?"),
    ]
    assert all(i.type == "message" and i.status == "completed" and i.id.startswith("msg_") for i in listed)
    # A row stored before held a message's content as a string and no status: listed the same way.
    org = await state_of(client).store.get_org("acme")
    stored = await state_of(client).store.get_response(org.id, response.id)
    old_items = json.dumps([{"id": "msg_old", "type": "message", "role": "user", "content": "Hi"}])
    await state_of(client).store.insert_response(
        org.id, StoredResponse("resp_old", stored.conversation_id, 2, stored.body_json, old_items, time.time())
    )
    (old,) = (await sdk.responses.input_items.list("resp_old")).data
    assert (old.id, old.content[0].type, old.content[0].text, old.status) == (
        "msg_old",
        "input_text",
        "Hi",
        "completed",
    )


async def test_a_conversation_is_created_with_openais_items_and_metadata(make_client):
    client = await make_client()
    sdk = await sdk_for(client)
    made = await sdk.conversations.create(
        items=[
            {"type": "message", "role": "system", "content": "Talk about rivers."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is a delta?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A river's mouth."}]},
        ],
        metadata={"topic": "rivers"},
    )
    assert isinstance(made.created_at, int) and made.metadata == {"topic": "rivers"}
    assert (await sdk.conversations.retrieve(made.id)).metadata == {"topic": "rivers"}
    updated = await sdk.conversations.update(made.id, metadata={"topic": "seas"})  # OpenAI's update: POST
    assert updated.metadata == {"topic": "seas"} and (await sdk.conversations.retrieve(made.id)).metadata == {
        "topic": "seas"
    }
    auth = {"Authorization": f"Bearer {sdk.api_key}"}
    patched = await client.patch(f"/v1/conversations/{made.id}", json={"metadata": None}, headers=auth)
    assert patched.status == 200 and (await patched.json())["metadata"] in ({}, None)
    refused = await client.patch(f"/v1/conversations/{made.id}", json={"metadata": {"k": 1}}, headers=auth)
    assert refused.status == 400
    await sdk.conversations.update(made.id, metadata={"topic": "rivers"})
    auth = {"Authorization": f"Bearer {sdk.api_key}"}
    got = await (await client.get(f"/v1/conversations/{made.id}", headers=auth)).json()
    assert [(m["role"], m["content"]) for m in got["messages"]] == [
        ("system", "Talk about rivers."),
        ("user", "What is a delta?"),
        ("assistant", "A river's mouth."),
    ]
    assert got["title"] == "What is a delta?" and isinstance(got["updated_at"], int)
    listed = await (await client.get("/v1/conversations", headers=auth)).json()
    assert listed["data"][0]["metadata"] == {"topic": "rivers"} and isinstance(listed["data"][0]["created_at"], int)
    # The conversation's messages are the history of the next chat turn.
    chat = await sdk.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "And an estuary?"}], extra_body={"conversation_id": made.id}
    )
    assert chat.usage.prompt_tokens > 20


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"items": "hello"}, "items"),
        ({"items": [{"role": "user", "content": "hi"}] * 21}, "items"),  # OpenAI's 20 at a time
        ({"items": [{"role": "robot", "content": "x"}]}, "items[0].role"),
        ({"items": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "items[0].content[0]"),
        ({"items": [{"type": "function_call", "call_id": "c", "name": "n", "arguments": "{}"}]}, "items[0]"),
        ({"metadata": {"topic": 5}}, "metadata.topic"),
        ({"metadata": "rivers"}, "metadata"),
        ({"title": "t", "colour": "blue"}, "colour"),
    ],
)
async def test_bad_conversation_fields_are_400s_naming_them_and_create_nothing(make_client, body, param):
    client = await make_client()
    resp = await client.post("/v1/conversations", json=body)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == param
    assert (await (await client.get("/v1/conversations")).json())["data"] == []


async def test_a_stored_response_is_replayed_as_its_stream_but_not_resumed_mid_way(make_client):
    client = await make_client()
    sdk = await sdk_for(client)
    live = [e async for e in await sdk.responses.create(model="echo", input="the river runs", stream=True)]
    replayed = [e async for e in await sdk.responses.retrieve(live[-1].response.id, stream=True)]
    assert [e.sequence_number for e in replayed] == list(range(len(replayed)))

    def collapsed(events) -> list[str]:  # the live stream sends a delta per token, the replay one
        kinds = [e.type for e in events]
        return [k for i, k in enumerate(kinds) if k != "response.output_text.delta" or kinds[i - 1] != k]

    assert collapsed(replayed) == collapsed(live)
    assert "".join(e.delta for e in replayed if e.type == "response.output_text.delta") == "the river runs"
    assert replayed[-1].response.model_dump() == live[-1].response.model_dump()
    # The replay's numbers are not the live stream's (one delta, not one per token): resuming a
    # live stream from its last number would skip text, so it is refused.
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.responses.retrieve(live[-1].response.id, stream=True, starting_after=2)
    assert refused.value.param == "starting_after"
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.responses.retrieve(live[-1].response.id, extra_query={"stream": "maybe"})
    assert bad.value.param == "stream"


async def test_a_background_response_still_running_is_not_streamed(make_client):
    client = await make_client(behaviour=FakeBehaviour(token_delay_s=0.2))
    sdk = await sdk_for(client)
    created = await sdk.responses.create(model="echo", input="the river runs to the sea", background=True)
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.responses.retrieve(created.id, stream=True)
    assert refused.value.param == "stream"
    await sdk.responses.cancel(created.id)


async def test_a_replay_carries_function_calls_and_ends_as_the_response_did():
    body = {
        "id": "resp_1",
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "weather",
                "arguments": "{}",
                "status": "completed",
            },
        ],
    }
    kinds = [e["type"] for e in await replay(body)]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    cancelled = await replay({"id": "resp_2", "status": "cancelled", "output": []})
    assert [e["type"] for e in cancelled][-1] == "response.failed" and cancelled[-1]["response"][
        "status"
    ] == "cancelled"


async def test_the_response_reports_the_temperature_and_top_p_it_sampled_with(aiohttp_client, tmp_path, tiny_model_dir):
    model_dir = tmp_path / "sampled"
    shutil.copytree(tiny_model_dir, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6, "top_p": 0.9}))
    app = init(echo_settings(tmp_path, model_dir), backend_factory=fake_backends(FakeBehaviour()))
    client = await aiohttp_client(app)
    sdk = await sdk_for(client)
    plain = await sdk.responses.create(model="echo", input="hi")
    assert (plain.temperature, plain.top_p) == (0.6, 0.9)  # the model's generation_config defaults
    assert (await sdk.responses.retrieve(plain.id)).temperature == 0.6
    cooler = await sdk.responses.create(model="echo", input="hi", temperature=0.2)
    assert (cooler.temperature, cooler.top_p) == (0.2, 0.9)
    events = [e async for e in await sdk.responses.create(model="echo", input="hi", stream=True)]
    assert (events[0].response.temperature, events[-1].response.top_p) == (0.6, 0.9)
    queued = await sdk.responses.create(model="echo", input="hi", background=True)
    assert queued.temperature == 0.6


async def test_openais_newer_fields_are_accepted_and_change_nothing(make_client):
    client = await make_client()
    sdk = await sdk_for(client)
    response = await sdk.responses.create(
        model="echo",
        input="hello",
        store=False,
        prompt_cache_key="session-1",
        safety_identifier="user-1",
        service_tier="auto",
        include=["reasoning.encrypted_content"],
        stream=True,
        stream_options={"include_obfuscation": False},
    )
    events = [e async for e in response]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "hello"


async def test_a_prompt_longer_than_the_context_is_a_400_naming_input(make_client):
    client = await make_client()
    sdk = await sdk_for(client)
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.responses.create(model="echo", input="word " * 2000)
    assert refused.value.param == "input" and refused.value.code == "context_length_exceeded"
    assert "the input" in refused.value.message


async def test_a_long_conversation_drops_its_oldest_turns_but_keeps_the_instructions(make_client):
    """As a stored chat conversation does: the history is trimmed to fit the context (the
    response says how many messages it dropped); the instructions are never dropped."""
    client = await make_client("tiers.enterprise.max_context_tokens=160")
    sdk = await sdk_for(client)
    backend = state_of(client).models["echo"].backend
    words = " ".join(f"w{i}" for i in range(30))
    await chain(sdk, *[(f"turn {n}: {words}", "Be brief.") for n in range(5)])  # no context_length_exceeded
    prompt = backend.requests[-1].chat.messages
    assert prompt[0] == {"role": "system", "content": "Be brief."}
    assert prompt[-1]["content"].startswith("turn 4") and not any("turn 0" in m["content"] for m in prompt)


async def test_input_tokens_of_a_long_chain_counts_the_trimmed_prompt_the_response_takes(make_client):
    """The count counted the whole stored history of previous_response_id, more than the answer's
    usage once the request dropped its oldest turns to fit; it fits the prompt as the request does.
    Unstored, the history goes in whole: too long, both are the same 400."""
    client = await make_client("tiers.enterprise.max_context_tokens=160")
    sdk = await sdk_for(client)
    backend = state_of(client).models["echo"].backend
    words = " ".join(f"w{i}" for i in range(30))
    last = await chain(sdk, *[(f"turn {n}: {words}", "Be brief.") for n in range(4)])
    follow = dict(model="echo", input=f"turn 4: {words}", instructions="Be brief.", previous_response_id=last.id)
    counted = await sdk.responses.input_tokens.count(**follow)
    answered = await sdk.responses.create(**follow)
    assert not any("turn 0" in m["content"] for m in backend.requests[-1].chat.messages)  # trimmed
    assert counted.input_tokens == answered.usage.input_tokens
    refusals = []
    for call in (sdk.responses.input_tokens.count, sdk.responses.create):  # the SDK's count takes no `store`
        with pytest.raises(openai.BadRequestError) as refused:
            await call(**follow, extra_body={"store": False})
        refusals.append((refused.value.status_code, refused.value.body))
    assert refusals[0] == refusals[1] and refusals[0][1]["code"] == "context_length_exceeded"


async def test_a_conversations_first_items_are_held_to_a_prompts_size(make_client):
    """Items had no size limit: a 2 MB conversation made every later turn re-tokenize it."""
    client = await make_client("server.max_prompt_chars=1000")
    items = [{"role": "user", "content": "word " * 150}] * 2  # 1,500 characters
    resp = await client.post("/v1/conversations", json={"items": items})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "items"
    assert (await client.post("/v1/conversations", json={"items": items[:1]})).status == 201
