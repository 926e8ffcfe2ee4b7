"""Structured outputs, tools and logprobs through the official `openai` SDK, native engine.

The model is tiny and random, so a valid JSON answer or valid tool arguments can only come from
grammar-constrained decoding; the arguments are checked with `jsonschema`, streamed and not.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.helpers import state_of

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}


@pytest.fixture
def sdk_client(native_client):
    return native_client


@pytest.fixture
async def sdk(sdk_client):
    client = sdk_client
    store = state_of(client).store
    await store.create_org("acme", "enterprise")
    _, key = await store.create_key("acme")
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0) as sdk:
        yield sdk


async def test_json_schema_answers_validate_streamed_and_not(sdk):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    unary = await sdk.chat.completions.create(
        model="tiny", messages=ASK, response_format=fmt, max_tokens=120, temperature=0
    )
    jsonschema.validate(json.loads(unary.choices[0].message.content), PERSON)
    assert unary.choices[0].finish_reason == "stop"
    stream = await sdk.chat.completions.create(
        model="tiny", messages=ASK, response_format=fmt, max_tokens=120, temperature=0.8, seed=5, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), PERSON)


async def test_a_named_tool_choice_gives_arguments_that_validate(sdk):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = await sdk.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120, temperature=0
    )
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


async def test_a_required_tool_choice_streams_delta_tool_calls_that_validate(sdk):
    stream = await sdk.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        temperature=0.7,
        seed=1,
        stream=True,
        parallel_tool_calls=False,
    )
    calls, finish = {}, None
    async for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


# What pydantic (and openai.pydantic_function_tool) writes for a nested model: a local $ref into $defs.
ADDRESS_TOOL = {
    "type": "function",
    "function": {
        "name": "ship",
        "parameters": {
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Place"}},
            "required": ["to"],
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {
                        "c": {"type": "string", "maxLength": 2},
                        "z": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["c", "z"],
                    "additionalProperties": False,
                }
            },
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_call_of_a_tool_whose_schema_uses_defs_validates(sdk, stream):
    """The tool's schema is embedded in the forced call's grammar with its references rebased."""
    kw = dict(model="tiny", messages=ASK, tools=[ADDRESS_TOOL], max_tokens=80, temperature=0)
    choice = {"type": "function", "function": {"name": "ship"}}
    if not stream:
        out = await sdk.chat.completions.create(tool_choice=choice, **kw)
        (call,) = out.choices[0].message.tool_calls
        arguments, finish = call.function.arguments, out.choices[0].finish_reason
    else:
        arguments, finish = "", None
        async for chunk in await sdk.chat.completions.create(tool_choice=choice, stream=True, **kw):
            for tc in chunk.choices[0].delta.tool_calls or []:
                arguments += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), ADDRESS_TOOL["function"]["parameters"])


@pytest.mark.parametrize(
    "parameters",
    [None, {"type": "object", "properties": {"c": {"type": "string", "maxLength": 2}}, "required": ["c"]}],
)
async def test_a_forced_call_of_a_tool_with_an_open_or_no_schema_ends_as_a_call(sdk, parameters):
    """Objects that do not say additionalProperties are closed under a forced call (Anthropic's
    tools never say it): a model cannot keep adding keys until the length limit."""
    function = {"name": "now"} if parameters is None else {"name": "now", "parameters": parameters}
    out = await sdk.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[{"type": "function", "function": function}],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        parallel_tool_calls=False,  # a random model would call again and again
    )
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "now"
    assert set(json.loads(call.function.arguments)) == ({"c"} if parameters else set())


async def test_a_forced_call_that_cannot_compile_is_a_400_before_the_stream(sdk_client):
    """A reference to nowhere: refused naming `tools`, not a 200 with an error inside the stream."""
    broken = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/Missing"}}}
    resp = await sdk_client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "stream": True, "tools": [broken], "tool_choice": "required"},
    )
    body = await resp.json()
    assert resp.status == 400 and body["error"]["param"].startswith("tools"), body


SELF_CONTAINING = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "schema", [{"$ref": "#"}, SELF_CONTAINING, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]
)
@pytest.mark.parametrize("forced_tool", [False, True])
async def test_a_schema_no_value_satisfies_is_a_400_before_the_stream(sdk_client, forced_tool, schema):
    """`{"$ref": "#"}` validates, but its grammar allows no first token: it was an empty 200; one
    whose every value must hold another gave a 200 with `{` and finish_reason stop."""
    body: dict = {"model": "tiny", "messages": ASK, "stream": True}
    if forced_tool:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required"
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    resp = await sdk_client.post("/v1/chat/completions", json=body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "JSON value satisfies it" in error["message"], error
    assert error["param"].startswith("tools" if forced_tool else "response_format"), error


@pytest.mark.parametrize("where", ["response_format", "tool", "forced_tool"])
async def test_a_schema_whose_references_chain_thousands_deep_is_a_400_and_the_server_lives(sdk_client, where):
    """A $ref chain of 3,000 aliases (~75 KB) overflowed llguidance's stack: the process died
    (SIGSEGV) on one free-tier request."""
    defs: dict = {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(3000)}
    defs["3000"] = {"type": "string"}
    schema = {"$defs": defs, "$ref": "#/$defs/0"}
    body: dict = {"model": "tiny", "messages": ASK, "stream": True}
    if where == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required" if where == "forced_tool" else "auto"
    resp = await sdk_client.post("/v1/chat/completions", json=body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "nests too deeply" in error["message"], error
    assert error["param"].startswith("tools" if "tool" in where else "response_format"), error
    alive = await sdk_client.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 2})
    assert alive.status == 200


async def test_a_tool_result_for_a_call_no_assistant_made_is_a_400(sdk_client):
    """OpenAI's 400: a result whose id matches no earlier call is a client bug the model was
    otherwise asked to make sense of."""
    made = {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": WEATHER_CALL}]}
    for messages, param in (
        ([*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}], "messages[1].tool_call_id"),
        ([*ASK, made, {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}], "messages[2].tool_call_id"),
    ):
        resp = await sdk_client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == param, error
    answered = [*ASK, made, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = await sdk_client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": answered})
    assert resp.status == 200, await resp.text()


async def test_a_tool_result_goes_back_through_the_template(sdk):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = await sdk.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=5, temperature=0
    )
    assert out.usage.prompt_tokens > 30


async def test_top_logprobs_give_alternatives_and_the_greedy_token_is_the_best(sdk):
    out = await sdk.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs))
        assert e.top_logprobs[0].token == e.token and bytes(e.bytes).decode("utf-8", "replace") == e.token
    stream = await sdk.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [e async for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
    ],
)
async def test_bad_values_of_new_parameters_are_400s_naming_them(sdk, body, param):
    with pytest.raises(openai.BadRequestError) as exc:
        await sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=body)
    assert exc.value.status_code == 400 and exc.value.param == param, exc.value.message


async def test_n_choices_share_the_prompt_and_a_seed_repeats_them(sdk, sdk_client):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me about the river. " * 4}],
        max_tokens=8,
        temperature=1.0,
        seed=11,
    )
    stats = state_of(sdk_client).models["tiny"].backend.stats
    hits_before = stats().prefix_cache_hits
    out = await sdk.chat.completions.create(n=3, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in (await sdk.chat.completions.create(n=3, logprobs=True, **kw)).choices
    )
    one = await sdk.chat.completions.create(n=1, **kw)
    assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert stats().prefix_cache_hits - hits_before >= 2 * 16  # choices 1 and 2 found the prompt's blocks
    again = await sdk.chat.completions.create(n=3, **kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    assert len({c.message.content for c in out.choices}) > 1
    stream = await sdk.chat.completions.create(n=3, stream=True, **kw)
    texts = ["", "", ""]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in out.choices]
    next_seed = await sdk.chat.completions.create(n=2, **{**kw, "seed": 12})  # a seed sweep: no repeats
    assert next_seed.choices[0].message.content != out.choices[1].message.content


async def test_logit_bias_forces_a_token_and_out_of_range_entries_are_400s(sdk, sdk_client):
    tokenizer = state_of(sdk_client).models["tiny"].tokenizer
    forced = tokenizer.encode("the")[-1]
    for create, body in (
        (sdk.completions.create, {"prompt": "Once upon"}),
        (sdk.chat.completions.create, {"messages": ASK}),
    ):
        answer = await create(model="tiny", max_tokens=4, temperature=0, logit_bias={str(forced): 100}, **body)
        text = answer.choices[0].text if hasattr(answer.choices[0], "text") else answer.choices[0].message.content
        assert text == tokenizer.decode([forced] * 4)
    for bias, says in (
        ({"99999999": 5}, "the token id 99999999; this model's ids run from 0 to"),
        ({"-3": 5}, "non-negative integers"),
        ({"12": 101}, "from -100 to 100"),
        ({"12": "high"}, "from -100 to 100"),
    ):
        with pytest.raises(openai.BadRequestError, match=says) as exc:
            await sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, stream=True, logit_bias=bias)
        assert exc.value.body["param"] == "logit_bias"
