"""The upstream backend against scripted OpenAI-compatible servers (in-process aiohttp apps
standing in for vLLM and the like): retries before the first token only, error mapping,
usage and who counted it, aborts that close the upstream connection, the API key."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import orjson
import pytest
from aiohttp import web

from engine.types import (
    ChatPrompt,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
    TokenText,
    UsageSource,
)
from engine.upstream.backend import UpstreamBackend
from engine.upstream.breaker import BreakerState, FailureKind
from engine.upstream.counting import EstimatingCounter
from settings import ModelConfig, UpstreamConfig


class Script:
    """One fake upstream: answers each chat request with `mode` and records what it saw."""

    def __init__(self, mode: str = "ok", words: int = 3, delay_s: float = 0.0, usage: bool = True):
        self.mode = mode
        self.words = words
        self.delay_s = delay_s
        self.usage = usage
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.num_disconnects = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "429":
            return web.json_response({"error": {"message": "busy"}}, status=429, headers={"Retry-After": "7"})
        if self.mode == "400":
            return web.json_response(
                {
                    "error": {
                        "message": "prompt too long for 2048",
                        "param": "messages",
                        "code": "context_length_exceeded",
                    }
                },
                status=400,
            )
        if self.mode == "silent":
            await asyncio.sleep(10)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await self._stream(response)
        except (ConnectionResetError, asyncio.CancelledError):
            self.num_disconnects += 1
            raise
        return response

    async def _stream(self, response: web.StreamResponse) -> None:
        async def send(payload: dict) -> None:
            await response.write(b"data: " + orjson.dumps(payload) + b"\n\n")

        await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        if self.mode == "reasoning":
            for delta in ({"reasoning_content": "Let me "}, {"reasoning_content": "think."}, {"content": "Hi!"}):
                await send({"choices": [{"index": 0, "delta": delta}]})
        if self.mode == "tool_call":
            for piece in (
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
                {"function": {"arguments": '{"city": '}},
                {"function": {"arguments": '"Paris"}'}},
            ):
                await send({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **piece}]}}]})
            await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
            await response.write(b"data: [DONE]\n\n")
            return
        for i in range(self.words):
            await asyncio.sleep(self.delay_s)
            choice = {"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}
            if self.mode == "logprobs":  # two tokens a chunk, each with one alternative
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": t,
                            "logprob": -0.5,
                            "bytes": list(t.encode()),
                            "top_logprobs": [
                                {"token": t, "logprob": -0.5, "bytes": list(t.encode())},
                                {"token": "x", "logprob": -2.0},
                            ],
                        }
                        for t in (f"w{i}", " ")
                    ]
                }
            await send({"choices": [choice]})
            if self.mode == "die_after_first" and i == 0:
                await send({"error": {"message": "worker crashed"}})
                return
        await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if self.usage:
            await send(
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 11,
                        "completion_tokens": self.words,
                        "prompt_tokens_details": {"cached_tokens": 4},
                    },
                }
            )
        await response.write(b"data: [DONE]\n\n")


async def serve(aiohttp_server, script: Script) -> str:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", script.chat)
    app.router.add_get("/v1/models", lambda _r: web.json_response({"data": [{"id": "m", "max_model_len": 2048}]}))
    server = await aiohttp_server(app)  # handler cancellation is on in test servers
    return str(server.make_url("/v1"))


@contextlib.asynccontextmanager
async def backend_for(urls: list[str], **model):
    config = UpstreamConfig(connect_timeout_s=1.0, first_token_timeout_s=0.5, idle_timeout_s=0.5, breaker_open_s=60.0)
    backend = UpstreamBackend(
        "m",
        ModelConfig(backend="openai", urls=urls, max_in_flight=4, **model),
        config,
        EstimatingCounter(),
        max_model_len=None,
    )
    await backend.start()
    try:
        yield backend
    finally:
        await backend.shutdown()


def request(request_id: str = "req_1", max_tokens: int = 16) -> GenerationRequest:
    chat = ChatPrompt(({"role": "user", "content": f"hello {request_id}"},))
    return GenerationRequest(request_id, (1, 2, 3), SamplingParams(max_tokens=max_tokens, temperature=0.0), chat=chat)


async def collect(backend: UpstreamBackend, req: GenerationRequest) -> list:
    return [event async for event in backend.generate(req)]


async def test_a_stream_is_relayed_chunk_by_chunk_and_billed_with_the_upstreams_usage(aiohttp_server):
    script = Script(words=3)
    async with backend_for([await serve(aiohttp_server, script)]) as backend:
        events = await collect(backend, request())
        assert backend.max_model_len == 2048  # learnt from GET /models
    assert [e.text for e in events] == ["w0 ", "w1 ", "w2 ", ""]
    last = events[-1]
    assert last.finish_reason is FinishReason.STOP and last.usage_source is UsageSource.UPSTREAM
    assert (last.num_prompt_tokens, last.num_cached_tokens, last.num_completion_tokens) == (11, 4, 3)
    assert script.bodies[0]["stream_options"] == {"include_usage": True}
    assert script.headers[0]["x-request-id"] == "req_1" and "authorization" not in script.headers[0]


async def test_logprobs_are_asked_for_and_relayed_as_text_tokens_with_their_chunk(aiohttp_server):
    script = Script("logprobs", words=2, usage=False)
    req = replace(request(), sampling=SamplingParams(max_tokens=16, temperature=0.0, logprobs=1))
    async with backend_for([await serve(aiohttp_server, script)]) as backend:
        events = await collect(backend, req)
    assert script.bodies[0]["logprobs"] is True and script.bodies[0]["top_logprobs"] == 1
    assert [[lp.text.text for lp in e.logprobs] for e in events] == [["w0", " "], ["w1", " "], []]
    first = events[0].logprobs[0]
    assert first.token_id is None and first.logprob == -0.5 and first.text.utf8 == tuple(b"w0")
    assert first.top_logprobs == ((TokenText("w0", tuple(b"w0")), -0.5), (TokenText("x", None), -2.0))
    assert events[1].num_completion_tokens == 4  # counted by logprob entries until the upstream reports usage


async def test_without_reported_usage_the_completion_is_estimated_and_says_so(aiohttp_server):
    async with backend_for([await serve(aiohttp_server, Script(words=2, usage=False))]) as backend:
        last = (await collect(backend, request()))[-1]
    assert last.usage_source is UsageSource.ESTIMATE
    assert last.num_prompt_tokens == 3 and last.num_completion_tokens == 2  # "w0 w1 ": 6 bytes, 2 estimated


async def test_a_5xx_before_the_first_token_is_retried_on_another_replica(aiohttp_server):
    failing, healthy = Script("500"), Script()
    urls = [await serve(aiohttp_server, failing), await serve(aiohttp_server, healthy)]
    async with backend_for(urls) as backend:
        backend.pool.replicas[1].num_in_flight = 1  # make the failing replica the first choice
        events = await collect(backend, request())
        backend.pool.replicas[1].num_in_flight = 0
        assert events[-1].finish_reason is FinishReason.STOP
        assert backend.pool.replicas[0].num_errors[FailureKind.SERVER_ERROR] == 1
        assert backend.pool.replicas[0].breaker.state is BreakerState.CLOSED  # one 5xx is below the threshold
    assert len(failing.bodies) == 1 and len(healthy.bodies) == 1


async def test_a_failure_after_the_first_token_is_not_retried_and_ends_the_stream_with_an_error(aiohttp_server):
    dying, healthy = Script("die_after_first"), Script()
    urls = [await serve(aiohttp_server, dying), await serve(aiohttp_server, healthy)]
    async with backend_for(urls) as backend:
        backend.pool.replicas[1].num_in_flight = 1
        received = []
        with pytest.raises(EngineUnavailable):
            async for event in backend.generate(request()):
                received.append(event.text)
        backend.pool.replicas[1].num_in_flight = 0
    assert received == ["w0 "] and healthy.bodies == []


async def test_an_upstream_400_is_the_callers_fault_and_is_not_retried(aiohttp_server):
    a, b = Script("400"), Script("400")
    async with backend_for([await serve(aiohttp_server, a), await serve(aiohttp_server, b)]) as backend:
        with pytest.raises(RequestRejected) as info:
            await collect(backend, request())
        assert all(r.breaker.state is BreakerState.CLOSED for r in backend.pool.replicas)
    assert info.value.message == "prompt too long for 2048" and info.value.code == "context_length_exceeded"
    assert len(a.bodies) + len(b.bodies) == 1


async def test_busy_everywhere_is_unavailable_with_the_upstreams_retry_after(aiohttp_server):
    urls = [await serve(aiohttp_server, Script("429")), await serve(aiohttp_server, Script("429"))]
    async with backend_for(urls) as backend:
        with pytest.raises(EngineUnavailable) as info:
            await collect(backend, request())
        assert backend.is_available()  # busy is not down
    assert info.value.retry_after_s == 7.0


async def test_a_silent_upstream_times_out_and_the_request_goes_to_the_next_replica(aiohttp_server):
    silent, healthy = Script("silent"), Script()
    urls = [await serve(aiohttp_server, silent), await serve(aiohttp_server, healthy)]
    async with backend_for(urls) as backend:
        backend.pool.replicas[1].num_in_flight = 1
        events = await collect(backend, request())
        backend.pool.replicas[1].num_in_flight = 0
        assert events[-1].finish_reason is FinishReason.STOP
        assert backend.pool.replicas[0].num_errors[FailureKind.TIMEOUT] == 1


async def test_a_refused_connection_takes_the_replica_out_and_the_model_is_unavailable_when_all_are(aiohttp_server):
    server = await aiohttp_server(web.Application())
    dead_url = str(server.make_url("/v1"))
    await server.close()  # nothing listens there any more
    async with backend_for([dead_url]) as backend:
        assert not backend.is_available()  # found at startup
        with pytest.raises(EngineUnavailable):
            await collect(backend, request())
        assert backend.has_room()  # admitted requests fail fast instead of waiting in our queue


async def test_closing_the_stream_early_closes_the_upstream_connection_and_frees_the_slot(aiohttp_server):
    script = Script(words=50, delay_s=0.02)
    async with backend_for([await serve(aiohttp_server, script)]) as backend:
        events = backend.generate(request())
        assert (await anext(events)).text == "w0 "
        assert backend.pool.replicas[0].num_in_flight == 1
        await events.aclose()
        assert backend.pool.replicas[0].num_in_flight == 0
        for _ in range(50):
            if script.num_disconnects:
                break
            await asyncio.sleep(0.02)
    assert script.num_disconnects == 1


async def test_abort_by_request_id_ends_the_stream_with_abort(aiohttp_server):
    script = Script(words=50, delay_s=0.02)
    async with backend_for([await serve(aiohttp_server, script)]) as backend:
        received = []
        async for event in backend.generate(request("req_9")):
            received.append(event)
            if len(received) == 2:
                backend.abort("req_9")
        assert backend.pool.replicas[0].num_in_flight == 0
    assert received[-1].finish_reason is FinishReason.ABORT and len(received) < 50
    assert received[-1].num_completion_tokens == 2


async def test_the_api_key_is_read_from_the_environment_and_sent_as_a_bearer_token(aiohttp_server, monkeypatch):
    script = Script()
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-upstream-secret")
    async with backend_for([await serve(aiohttp_server, script)], api_key_env="TEST_UPSTREAM_KEY") as backend:
        await collect(backend, request())
    assert script.headers[0]["authorization"] == "Bearer sk-upstream-secret"


async def test_a_missing_api_key_variable_stops_the_start_naming_the_variable_not_a_value():
    from settings import ConfigError

    backend = UpstreamBackend(
        "m",
        ModelConfig(backend="openai", urls=["http://127.0.0.1:9/v1"], api_key_env="SURELY_UNSET_UPSTREAM_KEY"),
        UpstreamConfig(),
        EstimatingCounter(),
        max_model_len=None,
    )
    with pytest.raises(ConfigError, match="SURELY_UNSET_UPSTREAM_KEY"):
        await backend.start()


async def test_abort_from_another_task_while_waiting_for_a_chunk_ends_the_stream_at_once(aiohttp_server):
    script = Script(words=5, delay_s=2.0)
    async with backend_for([await serve(aiohttp_server, script)]) as backend:
        backend._config = UpstreamConfig(first_token_timeout_s=30.0, idle_timeout_s=30.0)
        events = backend.generate(request("req_7"))
        asyncio.get_running_loop().call_later(0.2, backend.abort, "req_7")
        async with asyncio.timeout(1.5):  # well before the first chunk (2 s)
            received = [event async for event in events]
    assert [e.finish_reason for e in received] == [FinishReason.ABORT]


async def test_streamed_tool_calls_come_back_as_one_piece_of_tool_call_text(aiohttp_server):
    script = Script("tool_call")
    async with backend_for([await serve(aiohttp_server, script)]) as backend:
        events = await collect(backend, request())
    assert [e.text for e in events] == [
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>',
        "",
    ]
    assert events[-1].finish_reason is FinishReason.STOP


async def test_an_upstreams_reasoning_comes_back_as_think_text_for_our_splitter(aiohttp_server):
    async with backend_for([await serve(aiohttp_server, Script("reasoning", words=1))]) as backend:
        events = await collect(backend, request())
    assert "".join(e.text for e in events) == "<think>Let me think.</think>Hi!w0 "
