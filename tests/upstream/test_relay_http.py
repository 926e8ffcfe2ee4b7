"""The whole app in front of a stand-in upstream (in-process): what the client and the ledger get
when the upstream misbehaves: implausible usage, over-long lines, failures before and after the
first token, answers past max_tokens, cut tool calls; and where a relayed model's files are found."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from api.app import init
from settings import load_settings
from tests.api.helpers import assert_error, sse_events
from tests.upstream.helpers import USAGE, Sender, Upstream, chunk, serve_upstream

HELLO = [{"role": "user", "content": "Hello there, friend."}]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
    }
]


@pytest.fixture
def front(aiohttp_client, aiohttp_server, tmp_path):
    """The app with one relayed model, `up`, whose upstream runs `script` (priced, so billing shows)."""

    async def make(upstream: Upstream, *extra: str):
        url = await serve_upstream(aiohttp_server, upstream)
        settings = load_settings(
            None,
            [
                'models.up.backend="openai"',
                f'models.up.urls=["{url}"]',
                "models.up.price_input_per_mtok=1000.0",
                "models.up.price_output_per_mtok=1000.0",
                'tiers.enterprise.models=["up"]',
                f'store.path="{tmp_path / "chat.db"}"',
                "safety.enabled=false",
                "upstream.first_token_timeout_s=2.0",
                "upstream.idle_timeout_s=2.0",
                "upstream.max_attempts=1",
                *extra,
            ],
        )
        return await aiohttp_client(init(settings), server_kwargs={"handler_cancellation": True})

    return make


async def ledger_row(tmp_path, request_id: str) -> tuple:
    for _ in range(100):
        with sqlite3.connect(tmp_path / "chat.db") as con:
            row = con.execute(
                "SELECT status, prompt_tokens, completion_tokens, cost_usd, usage_source FROM usage"
                " WHERE request_id = ?",
                (request_id,),
            ).fetchone()
        if row is not None:
            return row
        await asyncio.sleep(0.05)
    raise AssertionError(f"no ledger row for {request_id}")


async def chat(client, **body):
    return await client.post("/v1/chat/completions", json={"model": "up", "messages": HELLO, **body})


async def negative_usage(send: Sender) -> None:
    for word in ("Hello", " there"):
        await send.data(chunk(word))
    await send.data(chunk("", finish="stop"))
    await send.data(chunk(usage={"prompt_tokens": -1000000, "completion_tokens": -1000000}))
    await send.done()


async def huge_line(send: Sender) -> None:
    await send.data(chunk("x" * (3 * 1024 * 1024)))
    await send.done()


async def error_400_after_a_token(send: Sender) -> None:
    await send.data(chunk("Hello"))
    await send.data({"object": "error", "message": "bad grammar state", "type": "BadRequestError", "code": 400})
    await send.done()


async def test_negative_usage_is_billed_on_our_own_count_streamed_and_not(front, tmp_path):
    client = await front(Upstream(negative_usage))
    resp = await chat(client)
    body = await resp.json()
    assert resp.status == 200 and body["usage"]["completion_tokens"] == 3  # "Hello there": 11 bytes
    row = await ledger_row(tmp_path, resp.headers["X-Request-Id"])
    assert row[0] == "finished" and row[1] > 0 and row[2] == 3 and row[4] == "estimate"

    resp = await chat(client, stream=True)
    events, _ = await sse_events(resp)  # well-formed frames to the end: no HTTP status line inside
    assert events[-1] == "[DONE]"
    assert (await ledger_row(tmp_path, resp.headers["X-Request-Id"]))[0] == "finished"


async def test_an_over_long_line_is_model_unavailable_with_a_ledger_row(front, tmp_path):
    client = await front(Upstream(huge_line))
    resp = await chat(client)
    await assert_error(resp, 503, code="model_unavailable")
    assert await ledger_row(tmp_path, resp.headers["X-Request-Id"]) == ("error", 0, 0, 0.0, "estimate")

    resp = await chat(client, stream=True)
    events, _ = await sse_events(resp)
    assert events[-1]["error"]["code"] == "model_unavailable" and "[DONE]" not in events
    assert (await ledger_row(tmp_path, resp.headers["X-Request-Id"]))[0] == "error"


async def test_a_request_failed_upstream_before_any_output_is_not_billed_and_says_who_counts(front, tmp_path):
    client = await front(Upstream(huge_line, refuse=(500, {"error": {"message": "boom"}})))
    resp = await chat(client)
    await assert_error(resp, 503, code="model_unavailable")
    assert await ledger_row(tmp_path, resp.headers["X-Request-Id"]) == ("error", 0, 0, 0.0, "estimate")


async def test_a_streamed_failure_says_when_to_retry_without_pointing_at_a_header(front):
    client = await front(Upstream(huge_line, refuse=(500, {"error": {"message": "boom"}})))
    events, _ = await sse_events(await chat(client, stream=True))
    message = events[-1]["error"]["message"]
    assert "header" not in message and "retry in" in message


async def test_an_upstream_error_after_the_first_token_ends_the_stream_as_model_unavailable(front, tmp_path):
    client = await front(Upstream(error_400_after_a_token))
    resp = await chat(client, stream=True)
    events, _ = await sse_events(resp)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.get("choices")) == "Hello"
    assert events[-1]["error"]["code"] == "model_unavailable" and "[DONE]" not in events
    assert (await ledger_row(tmp_path, resp.headers["X-Request-Id"]))[0] == "error"


async def test_an_answer_past_max_tokens_is_cut_there_and_billed_for_what_was_relayed(front, tmp_path):
    async def forever(send: Sender) -> None:
        while True:
            await send.data(chunk(" word"))
            await asyncio.sleep(0.002)

    client = await front(Upstream(forever))
    async with asyncio.timeout(10):
        resp = await chat(client, max_tokens=10)
        body = await resp.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"] == " word" * 10
    assert body["usage"]["completion_tokens"] <= 10
    assert (await ledger_row(tmp_path, resp.headers["X-Request-Id"]))[2] <= 10


@pytest.mark.parametrize(("pieces", "arguments"), [(['{"city": "Pa'], '{"city": "Pa'), ([], "")])
async def test_a_forced_tool_call_cut_by_max_tokens_comes_back_as_a_partial_call(front, pieces, arguments):
    async def cut_call(send: Sender) -> None:
        call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        await send.data(chunk(tool_calls=[call]))
        for piece in pieces:
            await send.data(chunk(tool_calls=[{"index": 0, "function": {"arguments": piece}}]))
        await send.data(chunk(finish="length"))
        await send.data(chunk(usage=USAGE))
        await send.done()

    client = await front(Upstream(cut_call))
    body = await (await chat(client, tools=TOOLS, tool_choice="required", max_tokens=5)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": arguments}


@pytest.mark.parametrize("reasoning", [None, "let me see"])
async def test_a_relayed_model_that_does_not_reason_has_no_reasoning_content(front, tiny_model_dir, reasoning):
    """Its template has no <think> tags: no reasoning_content, and reasoning its upstream sends
    anyway is counted but kept out of the content (its tags reached it)."""

    async def answer(send: Sender) -> None:
        if reasoning is not None:
            await send.data({"choices": [{"index": 0, "delta": {"reasoning_content": reasoning}}]})
        await send.data(chunk("Hello"))
        await send.data(chunk("", finish="stop"))
        await send.done()

    client = await front(Upstream(answer), f'models.up.tokenizer="{tiny_model_dir}"')
    message = (await (await chat(client)).json())["choices"][0]["message"]
    assert message["content"] == "Hello" and "reasoning_content" not in message


def test_a_relative_tokenizer_folder_is_found_beside_the_config_file(tmp_path):
    config = tmp_path / "conf" / "front.toml"
    config.parent.mkdir()
    config.write_text('[models.up]\nbackend = "openai"\nurls = ["http://gpu-a:8000/v1"]\ntokenizer = "tok/qwen"\n')
    settings = load_settings(config)
    assert settings.models["up"].tokenizer == str(tmp_path / "conf" / "tok" / "qwen")
