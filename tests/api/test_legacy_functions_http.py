"""OpenAI's deprecated `functions` / `function_call` (api/legacy_functions.py) through the
`openai` SDK on the native engine: rewritten into tools, answered in the old shape
(`message.function_call`, `finish_reason: "function_call"`), the same prompt as the tools form."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.test_structured_http import ASK, WEATHER, sdk, sdk_client  # noqa: F401  (fixtures)

FUNCTION = WEATHER["function"]
FORCED = {"name": "get_weather"}


async def test_a_forced_function_call_comes_back_as_function_call_unary_and_streamed(sdk):  # noqa: F811
    out = await sdk.chat.completions.create(
        model="tiny", messages=ASK, functions=[FUNCTION], function_call=FORCED, max_tokens=120, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    call = choice.message.function_call
    assert call.name == "get_weather" and choice.message.content is None
    jsonschema.validate(json.loads(call.arguments), FUNCTION["parameters"])

    stream = await sdk.chat.completions.create(
        model="tiny",
        messages=ASK,
        functions=[FUNCTION],
        function_call=FORCED,
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    names, arguments, finish = [], "", None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.tool_calls
        if delta.function_call is not None:
            names += [delta.function_call.name] if delta.function_call.name else []
            arguments += delta.function_call.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "function_call"
    assert json.loads(arguments) == json.loads(call.arguments)  # greedy: the same call


async def test_a_function_history_renders_the_prompt_the_tools_form_renders(sdk):  # noqa: F811
    arguments = '{"city": "Paris", "unit": "c"}'
    legacy = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": arguments}},
        {"role": "function", "name": "get_weather", "content": "sunny, 21 C"},
    ]
    tools = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_fn1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_fn1", "content": "sunny, 21 C"},
    ]
    old = await sdk.chat.completions.create(
        model="tiny", messages=legacy, functions=[FUNCTION], function_call="none", max_tokens=4, temperature=0
    )
    new = await sdk.chat.completions.create(
        model="tiny", messages=tools, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0
    )
    assert old.usage.prompt_tokens == new.usage.prompt_tokens > 30
    assert old.choices[0].message.content == new.choices[0].message.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [FUNCTION], "tools": [WEATHER]}, "functions"),
        ({"functions": [FUNCTION], "function_call": "any"}, "function_call"),
        ({"functions": [FUNCTION], "function_call": {"name": 3}}, "function_call"),
        ({"functions": {"name": "x"}}, "functions"),
        ({"functions": [FUNCTION], "function_call": FORCED, "tool_choice": "auto"}, "function_call"),
        ({"functions": [FUNCTION], "function_call": {"name": "nope"}}, "function_call"),
        ({"functions": [{"name": "x", "parameters": 3}]}, "functions[0].parameters"),
        ({"messages": [*ASK, {"role": "function", "content": "x"}]}, "messages[1].name"),
        ({"messages": [*ASK, {"role": "function", "name": "get_weather", "content": "x"}]}, "messages[1].name"),
        ({"messages": [*ASK, {"role": "assistant", "function_call": "get_weather"}]}, "messages[1].function_call"),
    ],
)
async def test_bad_legacy_fields_are_400s_naming_them(sdk_client, fields, param):  # noqa: F811
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **fields}
    resp = await sdk_client.post("/v1/chat/completions", json=body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == param, error
