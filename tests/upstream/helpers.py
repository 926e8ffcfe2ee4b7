"""Stand-in upstreams for tests: an in-process aiohttp app whose chat endpoint runs a script the
test writes (an async function given a `Sender`), recording what it was sent and whether our
side hung up. For misbehaviour the scripted servers of test_upstream_backend.py do not cover."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from engine.tokenizer import Tokenizer
from engine.types import ChatPrompt, GenerationRequest, SamplingParams
from engine.upstream.backend import UpstreamBackend
from engine.upstream.counting import Counter, EstimatingCounter, TokenizerCounter
from settings import ModelConfig, UpstreamConfig

USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}


def chunk(
    text: str | None = None,
    *,
    finish: str | None = None,
    reasoning: str | None = None,
    tool_calls: list[dict] | None = None,
    usage: dict | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk` payload: a delta of choice 0, or (usage) the usage-only last one."""
    if usage is not None:
        return {"object": "chat.completion.chunk", "choices": [], "usage": usage}
    delta: dict[str, Any] = {}
    if text is not None:
        delta["content"] = text
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class ThreadRecordingCounter(TokenizerCounter):
    """The tokenizer's counter, recording each count's text length and the thread it ran on."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer)
        self.counts: list[tuple[int, int]] = []

    def count(self, text: str) -> int:
        self.counts.append((len(text), threading.get_ident()))
        return super().count(text)


class Sender:
    """What a script writes with: data payloads, raw lines, [DONE]."""

    def __init__(self, response: web.StreamResponse, upstream: Upstream):
        self._response = response
        self._upstream = upstream

    async def data(self, payload: dict[str, Any]) -> None:
        await self.raw(b"data: " + orjson.dumps(payload) + b"\n\n")

    async def raw(self, data: bytes) -> None:
        await self._response.write(data)
        self._upstream.num_writes += 1

    async def done(self) -> None:
        await self.raw(b"data: [DONE]\n\n")


Script = Callable[[Sender], Awaitable[None]]


class Upstream:
    """One stand-in server. `script` answers a chat request with a 200 stream; `refuse`, when set,
    answers it instead (status, JSON body); `headers_delay_s` holds the response headers back."""

    def __init__(self, script: Script, *, refuse: tuple[int, dict] | None = None, headers_delay_s: float = 0.0):
        self.script = script
        self.refuse = refuse
        self.headers_delay_s = headers_delay_s
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.num_writes = 0
        self.num_disconnects = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.auth.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.headers_delay_s)
        if self.refuse is not None:
            return web.json_response(self.refuse[1], status=self.refuse[0])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await self.script(Sender(response, self))
        except (ConnectionResetError, asyncio.CancelledError):
            self.num_disconnects += 1
            raise
        return response

    async def wait_for_disconnect(self) -> bool:
        for _ in range(100):
            if self.num_disconnects:
                return True
            await asyncio.sleep(0.02)
        return False


async def serve_upstream(aiohttp_server, upstream: Upstream) -> str:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream.chat)
    app.router.add_get("/v1/models", lambda _r: web.json_response({"data": [{"id": "m"}]}))
    server = await aiohttp_server(app)  # handler cancellation is on in test servers
    return str(server.make_url("/v1"))


@contextlib.asynccontextmanager
async def backend_for(url: str, counter: Counter | None = None, api_key_env: str = "", **timeouts: float):
    config = UpstreamConfig(
        **{"connect_timeout_s": 1.0, "first_token_timeout_s": 0.5, "idle_timeout_s": 0.5, **timeouts},
        breaker_open_s=60.0,
    )
    model = ModelConfig(backend="openai", urls=[url], max_in_flight=4, api_key_env=api_key_env)
    backend = UpstreamBackend("m", model, config, counter or EstimatingCounter(), max_model_len=None)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.shutdown()


def request(max_tokens: int = 16, request_id: str = "req_1", **sampling: Any) -> GenerationRequest:
    chat = ChatPrompt(({"role": "user", "content": "hello"},))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return GenerationRequest(request_id, (1, 2, 3), params, chat=chat)


async def collect(backend: UpstreamBackend, req: GenerationRequest) -> list:
    return [event async for event in backend.generate(req)]
