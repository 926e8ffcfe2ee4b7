"""The relay against upstreams that misbehave: past max_tokens, implausible usage, over-long
lines, slow tool calls, missing headers, keep-alive comments forever, keys echoed in errors,
errors after the first token, stalls after a complete answer."""

from __future__ import annotations

import asyncio
import threading

import pytest
import structlog

from engine.tokenizer import Tokenizer
from engine.types import EngineUnavailable, FinishReason, RequestRejected, UsageSource
from engine.upstream.breaker import FailureKind
from engine.upstream.counting import TokenizerCounter
from engine.upstream.progress import OFF_LOOP_CHARS
from tests.upstream.helpers import (
    USAGE,
    Sender,
    ThreadRecordingCounter,
    Upstream,
    backend_for,
    chunk,
    collect,
    request,
    serve_upstream,
)


async def forever(send: Sender) -> None:
    """Ignores max_tokens: one word a chunk until the client hangs up."""
    i = 0
    while True:
        await send.data(chunk(f" w{i}"))
        i += 1
        await asyncio.sleep(0.002)


async def answer_with_usage(send: Sender, usage: dict) -> None:
    for word in ("Hello", " there"):
        await send.data(chunk(word))
    await send.data(chunk("", finish="stop"))
    await send.data(chunk(usage=usage))
    await send.done()


async def test_an_upstream_that_ignores_max_tokens_is_cut_there_with_length_and_hung_up_on(aiohttp_server):
    upstream = Upstream(forever)
    async with backend_for(await serve_upstream(aiohttp_server, upstream)) as backend:
        async with asyncio.timeout(5):
            events = await collect(backend, request(max_tokens=10))
        assert await upstream.wait_for_disconnect()
    assert [e.text for e in events[:-1]] == [f" w{i}" for i in range(10)]
    last = events[-1]
    assert last.finish_reason is FinishReason.LENGTH and last.num_completion_tokens <= 10
    assert last.usage_source is UsageSource.ESTIMATE


async def test_with_a_tokenizer_a_long_answer_is_cut_at_exactly_max_tokens_recounted_off_the_loop(
    aiohttp_server, tiny_model_dir
):
    """The relay recounts the whole output near max_tokens; a long recount runs on a worker thread
    (it held every other stream on the loop), and the answer is cut where it was: at the first
    sentence that would take it past max_tokens, billed at the tokenizer's count of what was relayed."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    counter, plain = ThreadRecordingCounter(tokenizer), TokenizerCounter(tokenizer)
    sentences = [f" Sentence {i}: the river flows to the sea." for i in range(1000)]

    async def ignores_max_tokens(send: Sender) -> None:
        for sentence in sentences:
            await send.data(chunk(sentence))

    limit = plain.count("".join(sentences[:400])) + 5
    async with backend_for(await serve_upstream(aiohttp_server, Upstream(ignores_max_tokens)), counter) as backend:
        events = await collect(backend, request(max_tokens=limit))
    relayed = "".join(e.text for e in events)
    num_relayed = len(events) - 1
    assert relayed == "".join(sentences[:num_relayed])
    assert plain.count(relayed) <= limit < plain.count(relayed + sentences[num_relayed])
    last = events[-1]
    assert last.finish_reason is FinishReason.LENGTH and last.usage_source is UsageSource.TOKENIZER
    assert last.num_completion_tokens == plain.count(relayed)
    long_ones = [thread for num_chars, thread in counter.counts if num_chars >= OFF_LOOP_CHARS]
    assert long_ones and threading.get_ident() not in long_ones


async def test_one_huge_chunk_past_max_tokens_is_not_relayed(aiohttp_server):
    async def one_huge_chunk(send: Sender) -> None:
        await send.data(chunk("x" * 4000))
        await send.data(chunk("", finish="stop"))
        await send.done()

    async with backend_for(await serve_upstream(aiohttp_server, Upstream(one_huge_chunk))) as backend:
        events = await collect(backend, request(max_tokens=10))
    assert [e.text for e in events] == [""]
    assert events[-1].finish_reason is FinishReason.LENGTH and events[-1].num_completion_tokens == 0


async def test_long_words_up_to_max_tokens_are_not_cut_on_the_estimate(aiohttp_server):
    async def compliant(send: Sender) -> None:
        for _ in range(4):
            await send.data(chunk(" extraordinary"))  # 14 bytes: 3.5 tokens by the estimate, 1 in truth
        await send.data(chunk("", finish="length"))
        await send.data(chunk(usage={"prompt_tokens": 5, "completion_tokens": 4}))
        await send.done()

    async with backend_for(await serve_upstream(aiohttp_server, Upstream(compliant))) as backend:
        events = await collect(backend, request(max_tokens=4))
    assert "".join(e.text for e in events) == " extraordinary" * 4
    assert events[-1].usage_source is UsageSource.UPSTREAM and events[-1].num_completion_tokens == 4


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 5, "completion_tokens": 10**9},  # a billion tokens for two words
        {"prompt_tokens": -1000000, "completion_tokens": -1000000},
        {"prompt_tokens": 10**7, "completion_tokens": 2},  # far more prompt than was sent
        {"prompt_tokens": "5", "completion_tokens": 2},
        {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 9}},
    ],
)
async def test_implausible_usage_is_replaced_by_our_own_count_and_logged_once_per_replica(aiohttp_server, usage):
    async def script(send: Sender) -> None:
        await answer_with_usage(send, usage)

    async with backend_for(await serve_upstream(aiohttp_server, Upstream(script))) as backend:
        with structlog.testing.capture_logs() as logs:
            events = [await collect(backend, request(request_id=f"req_{i}")) for i in range(2)]
    for received in events:
        last = received[-1]
        assert last.usage_source is UsageSource.ESTIMATE and last.finish_reason is FinishReason.STOP
        assert (last.num_prompt_tokens, last.num_cached_tokens, last.num_completion_tokens) == (3, 0, 3)
    assert [log["event"] for log in logs if log["log_level"] == "warning"] == ["upstream_usage_implausible"]


async def test_implausible_usage_is_recounted_with_the_tokenizer_when_there_is_one(aiohttp_server, tiny_model_dir):
    counter = TokenizerCounter(Tokenizer.from_dir(tiny_model_dir))

    async def script(send: Sender) -> None:
        await answer_with_usage(send, {"prompt_tokens": 5, "completion_tokens": 10**9})

    async with backend_for(await serve_upstream(aiohttp_server, Upstream(script)), counter) as backend:
        last = (await collect(backend, request()))[-1]
    assert last.usage_source is UsageSource.TOKENIZER
    assert last.num_completion_tokens == counter.count("Hello there")


async def test_a_line_longer_than_the_read_buffer_is_a_malformed_stream(aiohttp_server):
    async def huge_line(send: Sender) -> None:
        await send.data(chunk("x" * (3 * 1024 * 1024)))
        await send.done()

    async def huge_line_after_a_token(send: Sender) -> None:
        await send.data(chunk("Hello"))
        await huge_line(send)

    async with backend_for(await serve_upstream(aiohttp_server, Upstream(huge_line))) as backend:
        with pytest.raises(EngineUnavailable):
            await collect(backend, request())
        assert backend.pool.replicas[0].num_errors[FailureKind.SERVER_ERROR] == 1
    async with backend_for(await serve_upstream(aiohttp_server, Upstream(huge_line_after_a_token))) as backend:
        received = []
        with pytest.raises(EngineUnavailable):
            async for event in backend.generate(request()):
                received.append(event.text)
    assert received == ["Hello"]


async def test_a_tool_call_streaming_its_arguments_counts_as_the_first_token(aiohttp_server):
    async def slow_tool_call(send: Sender) -> None:
        call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        await send.data(chunk(tool_calls=[call]))
        for piece in ('{"city": ', '"Paris"', "}"):
            await asyncio.sleep(0.3)  # 0.9 s in all: past the first-token deadline, within the idle one
            await send.data(chunk(tool_calls=[{"index": 0, "function": {"arguments": piece}}]))
        await send.data(chunk(finish="tool_calls"))
        await send.done()

    url = await serve_upstream(aiohttp_server, Upstream(slow_tool_call))
    async with backend_for(url, first_token_timeout_s=0.5, idle_timeout_s=1.0) as backend:
        events = await collect(backend, request())
        assert backend.pool.replicas[0].num_errors[FailureKind.TIMEOUT] == 0
    assert events[0].text == '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


async def test_an_upstream_that_sends_no_headers_fails_on_the_first_token_deadline(aiohttp_server):
    upstream = Upstream(forever, headers_delay_s=30)
    async with backend_for(
        await serve_upstream(aiohttp_server, upstream), first_token_timeout_s=0.3, idle_timeout_s=30
    ) as backend:
        async with asyncio.timeout(3):  # the idle timeout (30 s) must not bound the wait for headers
            with pytest.raises(EngineUnavailable):
                await collect(backend, request())
        assert backend.pool.replicas[0].num_errors[FailureKind.TIMEOUT] == 1


async def test_keep_alive_comments_do_not_hold_a_silent_stream_open(aiohttp_server):
    async def pings_forever(send: Sender) -> None:
        await send.data(chunk("Hello"))
        while True:
            await asyncio.sleep(0.1)
            await send.raw(b": ping\n\n")

    async with backend_for(
        await serve_upstream(aiohttp_server, Upstream(pings_forever)), idle_timeout_s=0.5
    ) as backend:
        received = []
        async with asyncio.timeout(5):
            with pytest.raises(EngineUnavailable):
                async for event in backend.generate(request()):
                    received.append(event.text)
        assert backend.pool.replicas[0].num_errors[FailureKind.TIMEOUT] == 1
    assert received == ["Hello"]


@pytest.mark.parametrize("status", [401, 400])
async def test_the_api_key_echoed_in_an_upstream_error_is_neither_logged_nor_passed_on(
    aiohttp_server, monkeypatch, status
):
    key = "sk-UPSTREAMSECRET-9f8e7d6c"
    monkeypatch.setenv("TEST_UPSTREAM_KEY", key)
    upstream = Upstream(forever)
    async with backend_for(await serve_upstream(aiohttp_server, upstream), api_key_env="TEST_UPSTREAM_KEY") as backend:
        upstream.refuse = (
            status,
            {"error": {"message": f"Incorrect API key provided: Bearer {key} (also sk-other1234)"}},
        )
        with structlog.testing.capture_logs() as logs, pytest.raises((EngineUnavailable, RequestRejected)) as info:
            await collect(backend, request())
    assert upstream.auth == [f"Bearer {key}"]
    told = repr(logs) + str(info.value) + getattr(info.value, "message", "")
    assert "Incorrect API key provided" in told
    assert "UPSTREAMSECRET" not in told and "sk-other1234" not in told


async def test_an_error_event_after_the_first_token_ends_as_model_unavailable_whatever_its_code(aiohttp_server):
    async def error_400_after_tokens(send: Sender) -> None:
        await send.data(chunk("Hello"))
        await send.data({"object": "error", "message": "bad grammar state", "type": "BadRequestError", "code": 400})
        await send.done()

    async with backend_for(await serve_upstream(aiohttp_server, Upstream(error_400_after_tokens))) as backend:
        received = []
        with pytest.raises(EngineUnavailable):
            async for event in backend.generate(request()):
                received.append(event.text)
    assert received == ["Hello"]


@pytest.mark.parametrize("with_usage", [True, False])
async def test_a_complete_answer_whose_upstream_then_stalls_finishes_normally(aiohttp_server, with_usage):
    async def finish_then_hang(send: Sender) -> None:
        await send.data(chunk("Hello"))
        await send.data(chunk("", finish="stop"))
        if with_usage:
            await send.data(chunk(usage=USAGE))
        await asyncio.sleep(30)

    async with backend_for(await serve_upstream(aiohttp_server, Upstream(finish_then_hang))) as backend:
        async with asyncio.timeout(5):
            events = await collect(backend, request())
        assert sum(backend.pool.replicas[0].num_errors.values()) == 0
    last = events[-1]
    assert last.finish_reason is FinishReason.STOP
    assert last.usage_source is (UsageSource.UPSTREAM if with_usage else UsageSource.ESTIMATE)


async def test_events_of_a_model_with_a_tokenizer_say_the_tokenizer_counted_them(aiohttp_server, tiny_model_dir):
    counter = TokenizerCounter(Tokenizer.from_dir(tiny_model_dir))
    async with backend_for(await serve_upstream(aiohttp_server, Upstream(forever)), counter) as backend:
        events = backend.generate(request(max_tokens=50))
        first = await anext(events)
        await events.aclose()  # the client went away: this is what the ledger bills
    assert first.usage_source is UsageSource.TOKENIZER and first.num_completion_tokens >= 1


async def test_a_stop_reason_that_is_not_one_of_the_requests_stop_strings_is_not_passed_on(aiohttp_server):
    async def stop_reasons(send: Sender) -> None:
        await send.data(chunk("Hello"))
        payload = chunk("", finish="stop")
        payload["choices"][0]["stop_reason"] = "<not asked for>"
        await send.data(payload)
        await send.done()

    async with backend_for(await serve_upstream(aiohttp_server, Upstream(stop_reasons))) as backend:
        last = (await collect(backend, request(stop=("END",))))[-1]
    assert last.finish_reason is FinishReason.STOP and last.stop_str is None


async def test_a_tool_call_cut_by_max_tokens_is_relayed_open_as_a_native_model_leaves_it(aiohttp_server):
    async def cut_tool_call(send: Sender) -> None:
        call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        await send.data(chunk(tool_calls=[call]))
        await send.data(chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city": "Pa'}}]))
        await send.data(chunk(finish="length"))
        await send.done()

    async with backend_for(await serve_upstream(aiohttp_server, Upstream(cut_tool_call))) as backend:
        events = await collect(backend, request())
    assert events[0].text == '<tool_call>\n{"name":"get_weather","arguments": {"city": "Pa'
    assert events[-1].finish_reason is FinishReason.LENGTH
