"""The Responses API through the official `openai` SDK on the native engine (tiny random model).

Shows: text and message-item input, instructions, max_output_tokens; structured output via
text.format; a stored response continued with previous_response_id (prefix cache hit) after a
restart, and again from an earlier response (a branch, still a cache hit); GET/DELETE and
input_items; other organisations get 404; streaming events in order.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from api.app import init
from tests.api.helpers import native_settings, state_of

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
LOGPROBS = "message.output_text.logprobs"
LONG = "You are a helpful assistant who answers about rivers and the sea. " * 3


@pytest.fixture
def make_sdk(aiohttp_client, tmp_path, tiny_model_dir):
    async def make():
        settings = native_settings(tmp_path, tiny_model_dir)
        client = await aiohttp_client(init(settings), server_kwargs={"handler_cancellation": True})
        store = state_of(client).store
        keys = {}
        for org in ("acme", "other"):
            if await store.get_org(org) is None:
                await store.create_org(org, "enterprise")
            keys[org] = (await store.create_key(org))[1]
        url = str(client.make_url("/v1"))
        return client, {org: openai.AsyncOpenAI(base_url=url, api_key=k, max_retries=0) for org, k in keys.items()}

    return make


async def test_a_stored_response_is_continued_after_a_restart_and_hits_the_prefix_cache(make_sdk):
    client, sdk = await make_sdk()
    first = await sdk["acme"].responses.create(
        model="tiny", instructions=LONG, input="What is a river?", max_output_tokens=6, temperature=0
    )
    assert first.status in ("completed", "incomplete") and first.output[0].type == "message"
    assert first.usage.output_tokens <= 6 and first.id.startswith("resp_")
    conversations = await (
        await client.get("/v1/conversations", headers={"Authorization": f"Bearer {sdk['acme'].api_key}"})
    ).json()
    assert len(conversations["data"]) == 1  # the web UI lists it
    await client.server.close()
    await client.close()  # a restart: a new app over the same database file

    client, sdk = await make_sdk()
    again = await sdk["acme"].responses.retrieve(first.id)
    assert again.output_text == first.output_text
    ask = dict(model="tiny", instructions=LONG, max_output_tokens=4, temperature=0)  # re-sent: they do not carry over
    follow = await sdk["acme"].responses.create(**ask, previous_response_id=first.id, input="And the sea?")
    assert follow.usage.input_tokens > first.usage.input_tokens + 3  # sees the earlier turn
    follow2 = await sdk["acme"].responses.create(**ask, previous_response_id=follow.id, input="Thanks")
    assert follow2.usage.input_tokens_details.cached_tokens >= 16  # the history's blocks were cached
    items = await sdk["acme"].responses.input_items.list(first.id)
    assert [i.role for i in items.data] == ["user"]
    with pytest.raises(openai.NotFoundError):
        await sdk["other"].responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        await sdk["other"].responses.create(
            model="tiny", previous_response_id=first.id, input="hi", max_output_tokens=2
        )
    await sdk["acme"].responses.delete(follow2.id)
    with pytest.raises(openai.NotFoundError):
        await sdk["acme"].responses.retrieve(follow2.id)


async def test_continuing_from_an_earlier_response_again_finds_its_prompt_in_the_prefix_cache(make_sdk):
    _, sdk = await make_sdk()
    ask = dict(model="tiny", instructions=LONG, max_output_tokens=6, temperature=0)
    first = await sdk["acme"].responses.create(**ask, input="What is a river?")
    second = await sdk["acme"].responses.create(**ask, input="And the sea?", previous_response_id=first.id)
    again = await sdk["acme"].responses.create(**ask, input="And the sea?", previous_response_id=first.id)  # a branch
    assert again.output_text == second.output_text and again.usage.input_tokens == second.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 16  # all but a block


async def test_text_format_json_schema_validates_and_message_items_are_taken(make_sdk):
    _, sdk = await make_sdk()
    out = await sdk["acme"].responses.create(
        model="tiny",
        store=False,
        max_output_tokens=80,
        temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}],
        text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}},
    )
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    with pytest.raises(openai.NotFoundError):
        await sdk["acme"].responses.retrieve(out.id)  # store=false keeps nothing


async def test_streaming_events_arrive_in_order_and_end_with_response_completed(make_sdk):
    _, sdk = await make_sdk()
    stream = await sdk["acme"].responses.create(
        model="tiny", input="Tell me about the sea.", max_output_tokens=8, temperature=0, stream=True
    )
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    stored = await sdk["acme"].responses.retrieve(events[-1].response.id)
    assert stored.output_text == text


async def test_a_forced_function_call_is_a_function_call_item(make_sdk):
    _, sdk = await make_sdk()
    tool = {"type": "function", "name": "weather", "parameters": SCHEMA}
    out = await sdk["acme"].responses.create(
        model="tiny",
        input="Weather?",
        tools=[tool],
        max_output_tokens=80,
        tool_choice={"type": "function", "name": "weather"},
        temperature=0,
    )
    (call,) = [item for item in out.output if item.type == "function_call"]
    assert call.name == "weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "instructions": 3}, "instructions"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"if": {}}}}},
            "text.format.schema",
        ),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0]"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "description": 3}]}, "tools[0].description"),
        ({"input": "x", "tools": [{"type": "function", "name": "f b"}]}, "tools[0].name"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "x"}}, "tool_choice"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "x", "temperature": 9}, "temperature"),
        ({"input": "x", "reasoning_depth": 1}, "reasoning_depth"),
        ({"input": "x", "include": "message.output_text.logprobs"}, "include"),
        ({"input": "x", "include": ["computer_call_output.output.image_url"]}, "include"),
        ({"input": "x", "prompt_cache_key": 5}, "prompt_cache_key"),
        ({"input": "x", "service_tier": "bogus"}, "service_tier"),
        ({"input": "x", "text": {"verbosity": "x"}}, "text.verbosity"),
        ({"input": "x", "text": {"fromat": {"type": "text"}}}, "text.fromat"),
        ({"input": "x", "safety_identifier": ["u1"]}, "safety_identifier"),
        ({"input": "x", "service_tier": 1}, "service_tier"),
        ({"input": "x", "stream_options": "fast"}, "stream_options"),
        ({"input": "x", "stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
        ({"input": "x", "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
        ({"input": "x", "include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "include": [LOGPROBS], "top_logprobs": -1}, "top_logprobs"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"input": "x", "repetition_penalty": -1.2}, "repetition_penalty"),
        ({"input": "x", "repetition_penalty": "high"}, "repetition_penalty"),
    ],
)
async def test_bad_values_are_4xx_naming_the_parameter(make_sdk, body, param):
    _, sdk = await make_sdk()
    with pytest.raises(openai.APIStatusError) as exc:
        await sdk["acme"].responses.create(model="tiny", extra_body=body)
    assert exc.value.status_code in (400, 404) and exc.value.body["param"] == param, exc.value.body


async def test_prompt_over_the_character_limit_names_the_field_that_holds_it(make_client):
    client = await make_client("server.max_prompt_chars=100")
    for body, param in (
        ({"instructions": "i" * 101, "input": "x"}, "instructions"),
        ({"instructions": "i" * 60, "input": "x" * 60}, "input"),
        ({"input": "x" * 101}, "input"),
    ):
        resp = await client.post("/v1/responses", json={"model": "tiny", **body})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == param, await resp.text()


async def test_repetition_penalty_changes_the_answer_as_on_chat_completions(make_sdk):
    _, sdk = await make_sdk()
    ask = dict(model="tiny", input="Tell me about the sea.", max_output_tokens=16, temperature=0, store=False)
    plain = await sdk["acme"].responses.create(**ask)
    penalized = await sdk["acme"].responses.create(**ask, extra_body={"repetition_penalty": 1.8})
    chat = await sdk["acme"].chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": ask["input"]}],
        max_tokens=16,
        temperature=0,
        extra_body={"repetition_penalty": 1.8},
    )
    assert penalized.output_text == chat.choices[0].message.content
    assert penalized.output_text != plain.output_text  # the penalty reached the sampler


async def test_included_logprobs_are_on_the_output_text_and_its_stream_deltas(make_sdk):
    _, sdk = await make_sdk()
    ask = dict(model="tiny", input="Tell me about the sea.", max_output_tokens=6, temperature=0, store=False)
    chat = await sdk["acme"].chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": ask["input"]}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    out = await sdk["acme"].responses.create(**ask, include=[LOGPROBS], top_logprobs=3)
    part = out.output[0].content[0]
    assert part.text == chat.choices[0].message.content and out.top_logprobs == 3
    assert_same_logprobs(part.logprobs, chat.choices[0].logprobs.content)
    for e in part.logprobs:  # greedy: the chosen token is the most likely of its three alternatives
        assert len(e.top_logprobs) == 3 and e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs))
    stream = await sdk["acme"].responses.create(**ask, include=[LOGPROBS], top_logprobs=3, stream=True)
    events = [e async for e in stream]
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [e.token for e in part.logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx([e.logprob for e in part.logprobs], abs=1e-4)
    assert [len(lp.top_logprobs) for lp in streamed] == [3] * len(part.logprobs)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == [e.token for e in part.logprobs]
    assert_same_logprobs(events[-1].response.output[0].content[0].logprobs, part.logprobs)
    plain = await sdk["acme"].responses.create(**ask)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == part.text


def assert_same_logprobs(got, expected) -> None:
    """Same tokens, bytes and alternatives; logprobs up to float noise (a prefix-cache hit computes
    the prompt in other chunks)."""
    assert [(e.token, e.bytes) for e in got] == [(e.token, e.bytes) for e in expected] and expected
    for g, e in zip(got, expected, strict=True):
        assert g.logprob == pytest.approx(e.logprob, abs=1e-4)
        assert [t.token for t in g.top_logprobs] == [t.token for t in e.top_logprobs]


async def test_an_include_value_not_served_here_is_a_400_naming_it(make_sdk):
    _, sdk = await make_sdk()
    with pytest.raises(openai.BadRequestError) as exc:
        await sdk["acme"].responses.create(
            model="tiny", input="x", stream=True, include=[LOGPROBS, "file_search_call.results"]
        )
    assert exc.value.param == "include" and "'file_search_call.results'" in exc.value.message


async def test_input_tokens_counts_the_prompt_a_response_would_take_history_and_tools_included(make_sdk):
    _, sdk = await make_sdk()
    acme = sdk["acme"]
    ask = dict(model="tiny", instructions=LONG, input="What is a river?")
    counted = await acme.responses.input_tokens.count(**ask)
    assert counted.object == "response.input_tokens"
    first = await acme.responses.create(**ask, max_output_tokens=4, temperature=0)
    assert counted.input_tokens == first.usage.input_tokens
    follow = dict(model="tiny", previous_response_id=first.id, input="And the sea?")
    counted = await acme.responses.input_tokens.count(**follow)
    answered = await acme.responses.create(**follow, max_output_tokens=2, temperature=0)
    alone = await acme.responses.input_tokens.count(model="tiny", input="And the sea?")
    assert counted.input_tokens == answered.usage.input_tokens > alone.input_tokens + 5  # the history is counted
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    with_tool = await acme.responses.input_tokens.count(model="tiny", input="What is a river?", tools=[tool])
    without = await acme.responses.input_tokens.count(model="tiny", input="What is a river?")
    assert with_tool.input_tokens > without.input_tokens
    with pytest.raises(openai.NotFoundError):  # another organisation's response
        await sdk["other"].responses.input_tokens.count(**follow)
    with pytest.raises(openai.NotFoundError):
        await acme.responses.input_tokens.count(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError) as exc:
        await acme.responses.input_tokens.count(model="tiny", input=[{"type": "message", "role": "user"}])
    assert exc.value.body["param"].startswith("input")
    assert len((await acme.responses.input_items.list(first.id)).data) == 1  # nothing was stored by counting
