"""A reasoning model over HTTP: <think> text in reasoning_content (stream and unary), and
chat_template_kwargs reaching the template (enable_thinking), validated before any stream."""

from __future__ import annotations

import pytest

from api.app import init
from testing.fake_backend import fake_backends
from tests.api.helpers import THINKS, assert_error, echo_settings, sse_events, state_of


@pytest.fixture
async def client(aiohttp_client, tmp_path, thinking_model_dir):
    return await aiohttp_client(init(echo_settings(tmp_path, thinking_model_dir), backend_factory=fake_backends()))


async def chat(client, **body):
    return await client.post("/v1/chat/completions", json={"model": "echo", "messages": THINKS, **body})


async def test_unary_answer_carries_the_thinking_in_reasoning_content(client):
    resp = await chat(client)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Count the words.\n"
    assert message["content"] == "Three words here."
    # usage counts the thinking's tokens (the tags' included) among the completion's
    tokenizer = state_of(client).models["echo"].tokenizer
    thinking = len(tokenizer.encode("<think>\nCount the words.\n</think>"))
    usage = body["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == thinking
    assert usage["completion_tokens"] == len(tokenizer.encode(THINKS[0]["content"]))


async def test_stream_sends_reasoning_deltas_then_content_deltas(client):
    events, _ = await sse_events(await chat(client, stream=True))
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == ("Count the words.\n", "Three words here.")
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])


async def test_chat_template_kwargs_reach_the_template(client):
    plain = await (await chat(client)).json()
    no_thinking = await (await chat(client, chat_template_kwargs={"enable_thinking": False})).json()
    # The template adds an empty <think></think> block to the prompt when thinking is off.
    assert no_thinking["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "kwargs, param",
    [([1], "chat_template_kwargs"), ({"messages": []}, "chat_template_kwargs.messages")],
)
async def test_bad_chat_template_kwargs_are_a_400_naming_the_field(client, kwargs, param):
    await assert_error(await chat(client, stream=True, chat_template_kwargs=kwargs), 400, param=param)


async def test_reasoning_effort_none_turns_thinking_off_unless_the_template_kwargs_say_otherwise(client):
    async def prompt_tokens(**body) -> int:
        resp = await chat(client, **body)
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]["prompt_tokens"]

    plain = await prompt_tokens()
    off = await prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert off > plain
    assert await prompt_tokens(reasoning_effort="none") == await prompt_tokens(reasoning_effort="minimal") == off
    assert await prompt_tokens(reasoning_effort="high") == await prompt_tokens(reasoning_effort="low") == plain
    both = {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}
    assert await prompt_tokens(**both) == plain  # the explicit variable wins


async def test_the_responses_api_takes_reasoning_effort_the_same_way(client):
    async def input_tokens(**body) -> int:
        resp = await client.post("/v1/responses", json={"model": "echo", "input": THINKS[0]["content"], **body})
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]["input_tokens"]

    assert await input_tokens(reasoning={"effort": "none"}) > await input_tokens(reasoning={"effort": "medium"})
    assert await input_tokens(reasoning={"effort": "medium"}) == await input_tokens()


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": THINKS, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/v1/responses", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ("/v1/responses", {"input": "hi", "reasoning": "low"}, "reasoning"),
    ],
)
async def test_an_unknown_reasoning_effort_is_a_400_naming_the_field(client, path, body, param):
    await assert_error(await client.post(path, json={"model": "echo", **body}), 400, param=param)


async def test_a_stored_answer_keeps_its_thinking_count_in_the_ledger(client):
    """The web UI shows "(N thinking)" beside an answer; after a reload that count came from
    nowhere (the ledger did not keep it)."""
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    live = await (await chat(client, conversation_id=cid)).json()
    stored = (await (await client.get(f"/v1/conversations/{cid}")).json())["messages"][-1]
    thinking = live["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert thinking > 0 and stored["usage"]["completion_tokens_details"]["reasoning_tokens"] == thinking
