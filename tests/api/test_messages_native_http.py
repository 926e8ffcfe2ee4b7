"""Anthropic's Messages API and chat completions on the real native engine, where what the model
writes matters. A final assistant message continued (a prefill): the Messages API does it
whenever the last message is the assistant's, chat completions when asked
(`continue_final_message`, vLLM's name); the answer is exactly what the model writes after the
prefill's text, compared with a raw completion of the same rendered prompt. And the stop
sequence that ended an answer is named (`stop_reason: "stop_sequence"`)."""

from __future__ import annotations

import json

from tests.api.helpers import assert_error, state_of

ASK = {"role": "user", "content": "Tell me about the river."}
PREFILL = {"role": "assistant", "content": "The river is"}


async def _continuation_of(client, messages) -> str:
    """The raw completion of the prompt rendered with the last message left open."""
    tokenizer = state_of(client).models["tiny"].tokenizer
    ids = tokenizer.encode_chat(messages, continue_final_message=True)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return (await resp.json())["choices"][0]["text"]


async def test_the_messages_api_continues_an_assistant_prefill(native_client):
    expected = await _continuation_of(native_client, [ASK, PREFILL])
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [ASK, PREFILL]}
    resp = await native_client.post("/v1/messages", json=body)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert answer["content"][0]["text"] == expected
    counted = await native_client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": [ASK, PREFILL]})
    usage = answer["usage"]  # Anthropic's input_tokens leave out the prompt tokens read from cache
    assert (await counted.json())["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


async def test_chat_completions_continue_the_final_message_when_asked(native_client):
    expected = await _continuation_of(native_client, [ASK, PREFILL])
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [ASK, PREFILL]}
    resp = await native_client.post("/v1/chat/completions", json={**body, "continue_final_message": True})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"] == expected
    vllm_pair = {**body, "continue_final_message": True, "add_generation_prompt": False}  # as vLLM's docs send it
    same = await native_client.post("/v1/chat/completions", json=vllm_pair)
    assert (await same.json())["choices"][0]["message"]["content"] == expected
    for contradicting in (
        {"continue_final_message": True, "add_generation_prompt": True},
        {"add_generation_prompt": False},
    ):
        await assert_error(
            await native_client.post("/v1/chat/completions", json={**body, **contradicting}),
            400,
            param="add_generation_prompt",
        )
    plain = await (await native_client.post("/v1/chat/completions", json=body)).json()  # a new turn, as before
    assert plain["usage"]["prompt_tokens"] > (await resp.json())["usage"]["prompt_tokens"]
    refused = await native_client.post(
        "/v1/chat/completions", json={**body, "messages": [ASK], "continue_final_message": True}
    )
    await assert_error(refused, 400, param="continue_final_message")


async def test_the_stop_sequence_that_ended_an_answer_is_named(native_client):
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "messages": [ASK]}
    free = await (await native_client.post("/v1/messages", json=body)).json()
    text = free["content"][0]["text"]
    assert len(text) >= 6 and free["stop_reason"] == "max_tokens" and free["stop_sequence"] is None
    stop = text[3:5]
    at = text.index(stop)
    stops = ["\u2603 never", stop]
    answer = await (await native_client.post("/v1/messages", json={**body, "stop_sequences": stops})).json()
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("stop_sequence", stop)
    assert answer["content"][0]["text"] == text[:at]
    resp = await native_client.post("/v1/messages", json={**body, "stop_sequences": stops, "stream": True})
    deltas = [e for e in await _anthropic_events(resp) if e["type"] == "message_delta"]
    assert deltas[-1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


async def _anthropic_events(resp) -> list[dict]:
    assert resp.status == 200, await resp.text()
    lines = (await resp.read()).decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


async def test_a_continued_prefill_is_stored_as_one_answer_billed_once(native_client):
    cid = (await (await native_client.post("/v1/conversations", json={})).json())["id"]
    replayed = {"role": "assistant", "content": "An earlier answer."}
    messages = [ASK, replayed, {"role": "user", "content": "And then?"}, PREFILL]
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": messages, "conversation_id": cid}
    resp = await native_client.post("/v1/chat/completions", json={**body, "continue_final_message": True})
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    stored = (await (await native_client.get(f"/v1/conversations/{cid}")).json())["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[-1]["content"] == PREFILL["content"] + answer["choices"][0]["message"]["content"]
    assert [("usage" in m) for m in stored] == [False, False, False, True]  # the replayed answer is not billed
    assert stored[-1]["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]
