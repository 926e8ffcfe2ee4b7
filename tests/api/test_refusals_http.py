"""Refusals over HTTP (rules only, no classifier): a blocked prompt is answered with its
category's text, streamed and stored as the conversation's assistant message with
finish_reason content_filter; an answer the output filter stops is stored the same way."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer
from settings import SafetyConfig
from tests.api.helpers import sse_events

SAFETY_ON = ("safety.enabled=true", "safety.classifier=false")
CRISIS_TEXT = SafetyConfig().refusal_messages["self_harm"]


async def _new_conversation(client) -> str:
    return (await (await client.post("/v1/conversations", json={})).json())["id"]


async def _stored(client, cid: str) -> list[tuple[str, str, str | None]]:
    got = await (await client.get(f"/v1/conversations/{cid}")).json()
    return [(m["role"], m["content"], m.get("finish_reason")) for m in got["messages"]]


@pytest.mark.parametrize("stream", [True, False])
async def test_self_harm_prompt_gets_the_crisis_text_and_it_is_stored_as_the_answer(make_client, stream):
    client = await make_client(*SAFETY_ON)
    cid = await _new_conversation(client)
    prompt = "how do I kill myself"
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": "echo",
            "messages": [{"role": "user", "content": prompt}],
            "conversation_id": cid,
            "stream": stream,
        },
    )
    assert resp.status == 200
    if stream:
        events, _ = await sse_events(resp)
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
        finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1]
    else:
        body = await resp.json()
        text, finish = body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]
    assert text == CRISIS_TEXT and "crisis line" in text and finish == "content_filter"
    assert await _stored(client, cid) == [("user", prompt, None), ("assistant", CRISIS_TEXT, "content_filter")]


async def test_other_categories_get_the_default_refusal(make_client):
    client = await make_client(*SAFETY_ON)
    cid = await _new_conversation(client)
    prompt = "write me a keylogger"
    body = await (
        await client.post(
            "/v1/chat/completions",
            json={
                "model": "echo",
                "messages": [{"role": "user", "content": prompt}],
                "conversation_id": cid,
            },
        )
    ).json()
    refusal = SafetyConfig().refusal_message
    assert body["choices"][0]["message"]["content"] == refusal
    assert await _stored(client, cid) == [("user", prompt, None), ("assistant", refusal, "content_filter")]


async def test_error_mode_stores_no_answer(make_client):
    client = await make_client(*SAFETY_ON, 'safety.block_mode="error"')
    cid = await _new_conversation(client)
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": "echo",
            "messages": [{"role": "user", "content": "how do I kill myself"}],
            "conversation_id": cid,
        },
    )
    assert resp.status == 400
    assert [role for role, _, _ in await _stored(client, cid)] == ["user"]


async def test_answer_stopped_by_the_output_filter_is_stored_with_content_filter(make_client, tiny_model_dir):
    # The echo backend repeats the prompt, cut at max_tokens: "zebra crossing" passes the prompt
    # rules, the answer "zebra" (cut before " crossing") matches the operator's deny rule.
    client = await make_client(*SAFETY_ON, 'safety.deny={weapons=["zebra(?! crossing)"]}')
    cid = await _new_conversation(client)
    num_tokens = len(Tokenizer.from_dir(tiny_model_dir).encode("zebra"))
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": "echo",
            "messages": [{"role": "user", "content": "zebra crossing"}],
            "conversation_id": cid,
            "stream": True,
            "max_tokens": num_tokens,
        },
    )
    events, _ = await sse_events(resp)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "content_filter"
    stored = await _stored(client, cid)
    assert stored[0] == ("user", "zebra crossing", None)
    assert stored[1][0] == "assistant" and "zebra" not in stored[1][1] and stored[1][2] == "content_filter"


async def test_normal_answers_store_their_finish_reason(make_client):
    client = await make_client()
    cid = await _new_conversation(client)
    await client.post(
        "/v1/chat/completions",
        json={
            "model": "echo",
            "messages": [{"role": "user", "content": "one two three four five"}],
            "conversation_id": cid,
            "max_tokens": 2,
        },
    )
    await client.post(
        "/v1/chat/completions",
        json={
            "model": "echo",
            "messages": [{"role": "user", "content": "hi"}],
            "conversation_id": cid,
        },
    )
    assert [f for role, _, f in await _stored(client, cid) if role == "assistant"] == ["length", "stop"]


async def test_an_assistant_prefill_is_screened_as_the_callers_text(make_client):
    """A prefill the model would continue is the caller's text: the prompt screen reads it."""
    client = await make_client(*SAFETY_ON)
    messages = [
        {"role": "user", "content": "Continue your answer."},
        {"role": "assistant", "content": "how do I kill myself"},
    ]
    resp = await client.post("/v1/messages", json={"model": "echo", "max_tokens": 8, "messages": messages})
    assert resp.status == 200
    answer = await resp.json()
    assert answer["stop_reason"] == "refusal" and answer["content"][0]["text"] == CRISIS_TEXT
    body = {"model": "echo", "max_tokens": 8, "messages": messages, "continue_final_message": True}
    chat = await (await client.post("/v1/chat/completions", json=body)).json()
    assert chat["choices"][0]["finish_reason"] == "content_filter"


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_blocked_prompt_asked_for_n_choices_gets_the_refusal_in_each(make_client, stream, path):
    """Only choice 0 came back: code that reads choices[1] broke on a refusal."""
    client = await make_client(*SAFETY_ON)
    prompt = "how do I kill myself"
    ask = (
        {"messages": [{"role": "user", "content": prompt}]} if path.endswith("chat/completions") else {"prompt": prompt}
    )
    resp = await client.post(path, json={"model": "echo", "n": 2, "stream": stream, "temperature": 1, **ask})
    assert resp.status == 200

    def text_of(choice: dict) -> str:
        return choice.get("text") or choice.get("message", choice.get("delta", {})).get("content") or ""

    if stream:
        events, _ = await sse_events(resp)
        choices = [c for e in events[:-1] for c in e["choices"]]
    else:
        choices = (await resp.json())["choices"]
    for index in (0, 1):
        mine = [c for c in choices if c["index"] == index]
        assert "".join(text_of(c) for c in mine) == CRISIS_TEXT
        assert mine[-1]["finish_reason"] == "content_filter"
