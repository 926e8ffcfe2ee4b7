"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
`anthropic` SDK.

Against the real native engine (tiny Llama): the same conversation answered over /v1/messages
and /v1/chat/completions gives the same text and prompt tokens (system prompt, tool use and tool
results included), streamed or not; a forced tool comes back as a `tool_use` block whose input
validates against its schema (grammar-constrained, so a random model can only get it right that
way). Against the fake backend: Anthropic's error envelope, `x-api-key`, a mid-stream failure as
an `error` event, and the safety gate's refusal.
"""

from __future__ import annotations

import anthropic
import jsonschema
import orjson
import pytest

from api.app import init
from api.attachments import OFF_LOOP_CHARS
from api.prompt import encode_chat
from api.protocol import ChatMessage
from settings import SafetyConfig
from testing.fake_backend import FakeBehaviour, fake_backends
from tests.api.helpers import THINKS, echo_settings, state_of

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "Current weather in a city.", "input_schema": WEATHER_SCHEMA}
SYSTEM = "You answer in one short sentence."
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the SDK no longer takes temperature as an argument


@pytest.fixture
def native(native_client):
    return native_client


async def _key(client) -> str:
    store = state_of(client).store
    await store.create_org("acme", "enterprise")
    return (await store.create_key("acme"))[1]


@pytest.fixture
async def sdk(native):
    async with anthropic.AsyncAnthropic(
        base_url=str(native.make_url("")), api_key=await _key(native), max_retries=0
    ) as c:
        yield c


async def _chat(client, messages, **extra) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, **extra}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_a_message_is_answered_as_chat_completions_answers_it(native, sdk):
    chat = await _chat(native, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=12)
    msg = await sdk.messages.create(model="tiny", system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    stop = {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert msg.stop_reason == stop
    cached = msg.usage.cache_read_input_tokens
    assert msg.usage.input_tokens + cached == chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    counted = await sdk.messages.count_tokens(model="tiny", system=SYSTEM, messages=ASK)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


async def test_the_stream_gives_the_same_text_as_named_events(native, sdk):
    unary = await sdk.messages.create(model="tiny", messages=ASK, max_tokens=12, extra_body=GREEDY)
    async with sdk.messages.stream(model="tiny", messages=ASK, max_tokens=12, extra_body=GREEDY) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == unary.content[0].text == final.content[0].text
    assert final.stop_reason == unary.stop_reason and final.usage.output_tokens == unary.usage.output_tokens
    # The wire: every frame named by its type, no [DONE].
    resp = await native.post(
        "/v1/messages", json={"model": "tiny", "messages": ASK, "max_tokens": 3, "stream": True, "temperature": 0}
    )
    frames = (await resp.read()).decode().strip().split("\n\n")
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames if not f.startswith(":")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "[DONE]" not in frames[-1]
    for f in frames:
        if not f.startswith(":"):
            name, data = f.split("\n")
            assert orjson.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_tool_comes_back_as_a_tool_use_block_that_validates(sdk, stream):
    fields = {
        "model": "tiny",
        "messages": ASK,
        "max_tokens": 120,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    if stream:
        async with sdk.messages.stream(**fields) as s:
            msg = await s.get_final_message()
    else:
        msg = await sdk.messages.create(**fields)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")  # Anthropic's ids
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    assert msg.stop_reason == "tool_use"


async def test_tool_use_and_tool_result_blocks_render_as_chat_tool_calls_do(native, sdk):
    args = {"city": "Paris", "unit": "c"}
    anthropic_history = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": args},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}],
        },
    ]
    chat_history = [
        *ASK,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": orjson.dumps(args).decode()},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
    ]
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER_SCHEMA},
    }
    chat = await _chat(native, chat_history, tools=[tool], max_tokens=6)
    msg = await sdk.messages.create(
        model="tiny", messages=anthropic_history, tools=[WEATHER], max_tokens=6, extra_body=GREEDY
    )
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    counted = await sdk.messages.count_tokens(model="tiny", messages=anthropic_history, tools=[WEATHER])
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


async def test_a_message_is_billed_in_the_usage_ledger(native):
    key = await _key(native)
    async with anthropic.AsyncAnthropic(base_url=str(native.make_url("")), api_key=key, max_retries=0) as sdk:
        msg = await sdk.messages.create(model="tiny", messages=ASK, max_tokens=5)
    usage = await (await native.get("/v1/usage", headers={"Authorization": f"Bearer {key}"})).json()
    assert usage["total"]["num_requests"] == 1
    assert usage["total"]["completion_tokens"] == msg.usage.output_tokens


async def test_max_tokens_is_a_cap_so_a_large_ask_gets_the_room_left(make_client):
    client = await make_client()  # enterprise: max_tokens 64, context 400
    body = {"model": "echo", "max_tokens": 32000, "messages": [{"role": "user", "content": "hello there"}]}
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 200, await resp.text()
    (request,) = state_of(client).models["echo"].backend.requests
    assert request.sampling.max_tokens == 64
    chat = {"model": "echo", "max_tokens": 32000, "messages": body["messages"]}
    assert (await client.post("/v1/chat/completions", json=chat)).status == 400  # chat completions: strict


# -- the fake backend: errors, keys, refusals ---------------------------------------------


async def _error(resp, status: int, kind: str) -> str:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "kind", "status", "where"),
    [
        ({"messages": ASK}, "invalid_request_error", 400, "max_tokens"),
        ({"max_tokens": 5}, "invalid_request_error", 400, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "invalid_request_error", 400, "role"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "invalid_request_error",
            400,
            "param: messages[0].content[0].source",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "search_result"}]}]},
            "invalid_request_error",
            400,
            "'search_result' block is not supported",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "invalid_request_error",
            400,
            "tools[0]",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "sometimes"}},
            "invalid_request_error",
            400,
            "tool_choice",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "stop_sequences": ["a", "b", "c", "d", "e"]},
            "invalid_request_error",
            400,
            "stop_sequences",
        ),
        ({"max_tokens": 5, "messages": ASK, "temperature": 3}, "invalid_request_error", 400, "temperature"),
        (
            {
                "max_tokens": 5,
                "messages": [*ASK, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}],
            },
            "invalid_request_error",
            400,
            "messages[1].content[0].tool_use_id",
        ),
        ({"max_tokens": 5, "messages": ASK, "temperature": 1.5}, "invalid_request_error", 400, "0 and 1"),
        (
            {"max_tokens": 5, "messages": ASK, "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]},
            "invalid_request_error",
            400,
            "mcp_servers",
        ),
        ({"max_tokens": 5, "messages": ASK, "model": "nope"}, "not_found_error", 404, "nope"),
    ],
)
async def test_bad_requests_get_anthropics_error_envelope(make_client, fields, kind, status, where):
    client = await make_client()
    resp = await client.post("/v1/messages", json={"model": "echo", **fields})
    assert resp.headers["request-id"] == resp.headers["X-Request-Id"]  # where Anthropic's SDK looks
    assert where in await _error(resp, status, kind)
    assert state_of(client).models["echo"].backend.requests == []


async def test_a_key_is_read_from_x_api_key_and_a_wrong_one_is_an_authentication_error(make_client):
    client = await make_client()
    key = await _key(client)
    body = {"model": "echo", "max_tokens": 20, "messages": [{"role": "user", "content": "hello there"}]}
    resp = await client.post("/v1/messages", json=body, headers={"x-api-key": key})
    assert resp.status == 200 and (await resp.json())["content"][0]["text"] == "hello there"  # the fake echoes
    await _error(
        await client.post("/v1/messages", json=body, headers={"x-api-key": "sk-" + "w" * 43}),
        401,
        "authentication_error",
    )


async def test_count_tokens_counts_against_the_request_limit(make_client):
    client = await make_client("tiers.enterprise.requests_per_minute=2")
    body = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}]}
    for _ in range(2):
        resp = await client.post("/v1/messages/count_tokens", json=body)
        assert resp.status == 200 and (await resp.json())["input_tokens"] > 0
        assert resp.headers["x-ratelimit-limit-requests"] == "2"
    resp = await client.post("/v1/messages/count_tokens", json=body)
    await _error(resp, 429, "rate_limit_error")
    assert "Retry-After" in resp.headers


async def test_a_failure_mid_stream_is_an_error_event(make_client):
    client = await make_client(behaviour=FakeBehaviour(fail_after=2))
    body = {
        "model": "echo",
        "max_tokens": 20,
        "stream": True,
        "messages": [{"role": "user", "content": "one two three four"}],
    }
    frames = (await (await client.post("/v1/messages", json=body)).read()).decode().strip().split("\n\n")
    name, data = frames[-1].split("\n")
    assert name == "event: error"
    assert orjson.loads(data.removeprefix("data: "))["error"]["type"] == "api_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_blocked_prompt_gets_the_refusal_with_stop_reason_refusal(make_client, stream):
    client = await make_client("safety.enabled=true", "safety.classifier=false")
    key = await _key(client)
    async with anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key=key, max_retries=0) as sdk:
        fields = {"model": "echo", "max_tokens": 20, "messages": [{"role": "user", "content": "how do I kill myself"}]}
        if stream:
            async with sdk.messages.stream(**fields) as s:
                msg = await s.get_final_message()
        else:
            msg = await sdk.messages.create(**fields)
    assert msg.stop_reason == "refusal" and msg.content[0].text == SafetyConfig().refusal_messages["self_harm"]
    assert msg.usage.input_tokens == 0  # a refused prompt is not billed
    assert state_of(client).models["echo"].backend.requests == []


# -- a reasoning model --------------------------------------------------------------------


@pytest.fixture
async def thinker(aiohttp_client, tmp_path, thinking_model_dir):
    return await aiohttp_client(init(echo_settings(tmp_path, thinking_model_dir), backend_factory=fake_backends()))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reasoning_model_thinks_only_when_asked_and_its_thinking_is_a_thinking_block(thinker, stream):
    key = await _key(thinker)
    async with anthropic.AsyncAnthropic(base_url=str(thinker.make_url("")), api_key=key, max_retries=0) as sdk:
        fields = {"model": "echo", "max_tokens": 40, "messages": THINKS}
        thinking = {"type": "enabled", "budget_tokens": 1024}
        if stream:
            async with sdk.messages.stream(**fields, thinking=thinking) as s:
                msg = await s.get_final_message()
        else:
            msg = await sdk.messages.create(**fields, thinking=thinking)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert msg.content[0].thinking == "Count the words.\n" and msg.content[1].text == "Three words here."
        # Without `thinking` the template is told enable_thinking=false: it closes an empty
        # <think></think> in the prompt (more prompt tokens), as Anthropic's models do not think unasked.
        counted_off = await sdk.messages.count_tokens(model="echo", messages=THINKS)
        counted_on = await sdk.messages.count_tokens(model="echo", messages=THINKS, thinking=thinking)
        assert counted_off.input_tokens > counted_on.input_tokens


async def test_a_long_prompt_is_counted_the_same_off_the_loop(make_client):
    """Past OFF_LOOP_CHARS the prompt is tokenized on a worker thread; the count is the same."""
    client = await make_client("server.max_body_bytes=200000", "server.max_prompt_chars=200000")
    model = state_of(client).models["echo"]
    words = "lorem ipsum dolor " * (OFF_LOOP_CHARS // 18 + 1)
    messages = [{"role": "user", "content": words}]
    resp = await client.post("/v1/messages/count_tokens", json={"model": "echo", "messages": messages})
    assert resp.status == 200, await resp.text()
    expected = len(encode_chat(model, [ChatMessage("user", words)], (), None))
    assert (await resp.json())["input_tokens"] == expected
