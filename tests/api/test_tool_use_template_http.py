"""A folder with a "tool_use" chat template beside its "default" one (Hermes-2-Pro, older Command-R):
as transformers does, a request whose tools reach the template renders with the tool_use one, on
every endpoint, and reads its tool-call format and thinking from it; the rest with the default."""

from __future__ import annotations

import json
import shutil

import orjson
import pytest

from api.app import init
from engine.tokenizer import Tokenizer
from engine.upstream.counting import TokenizerCounter
from testing.fake_backend import fake_backends
from testing.tiny_model import CHAT_TEMPLATE
from tests.api.helpers import echo_settings, state_of

# Both ChatML, so the echo backend answers with the last user message. The tool_use one writes a
# marker, calls tools in Mistral's format and opens the thinking; the default one does neither.
DEFAULT = "[default]\n" + CHAT_TEMPLATE
TOOL_USE = (
    "[tool_use] {{ tools | length }} tools, called as [TOOL_CALLS], after <think>...</think>\n"
    + CHAT_TEMPLATE
    + "{% if add_generation_prompt %}<think>\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = 'Plan.</think>[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.fixture
def named_dir(tiny_model_dir, tmp_path):
    folder = tmp_path / "named"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": DEFAULT}, {"name": "tool_use", "template": TOOL_USE}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


async def _client(aiohttp_client, tmp_path, folder, *extra: str):
    room = ("tiers.enterprise.max_tokens=200", "tiers.enterprise.max_context_tokens=1000")
    settings = echo_settings(tmp_path, folder, (*room, *extra))
    return await aiohttp_client(init(settings, backend_factory=fake_backends()))


def _last_prompt(client) -> str:
    model = state_of(client).models["echo"]
    return model.tokenizer.decode(model.backend.requests[-1].prompt_token_ids, skip_special_tokens=False)


async def test_a_chat_with_tools_renders_with_the_tool_use_template_and_reads_its_format_and_thinking(
    aiohttp_client, tmp_path, named_dir
):
    client = await _client(aiohttp_client, tmp_path, named_dir)
    body = {"model": "echo", "messages": [{"role": "user", "content": CALL}], "max_tokens": 200}
    resp = await client.post("/v1/chat/completions", json={**body, "tools": [WEATHER]})
    assert resp.status == 200, await resp.text()
    message = (await resp.json())["choices"][0]["message"]
    assert _last_prompt(client).startswith("[tool_use] 1 tools")
    assert message["reasoning_content"] == "Plan."  # the tool_use template opened the thinking
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]  # parsed as Mistral's
    for without in ({}, {"tools": [WEATHER], "tool_choice": "none"}):  # no tools reach the template
        resp = await client.post("/v1/chat/completions", json={**body, **without})
        message = (await resp.json())["choices"][0]["message"]
        assert _last_prompt(client).startswith("[default]\n<|im_start|>user")
        assert message["content"] == CALL and not message.get("tool_calls") and not message.get("reasoning_content")


async def test_messages_responses_and_token_counts_render_a_request_with_tools_with_the_tool_use_template(
    aiohttp_client, tmp_path, named_dir
):
    client = await _client(aiohttp_client, tmp_path, named_dir)
    tokenizer = state_of(client).models["echo"].tokenizer
    anthropic_tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    body = {"model": "echo", "max_tokens": 200, "tools": [anthropic_tool]}
    resp = await client.post("/v1/messages", json={**body, "messages": [{"role": "user", "content": CALL}]})
    assert resp.status == 200, await resp.text()
    assert _last_prompt(client).startswith("[tool_use] 1 tools")
    blocks = (await resp.json())["content"]
    assert [b["input"] for b in blocks if b["type"] == "tool_use"] == [{"city": "Paris"}]
    responses_tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    resp = await client.post(
        "/v1/responses", json={"model": "echo", "input": CALL, "tools": [responses_tool], "max_output_tokens": 200}
    )
    assert resp.status == 200, await resp.text()
    assert _last_prompt(client).startswith("[tool_use] 1 tools")
    output = (await resp.json())["output"]
    assert [item["name"] for item in output if item["type"] == "function_call"] == ["get_weather"]
    rendered = "[tool_use] 1 tools, called as [TOOL_CALLS], after <think>...</think>\n"
    rendered += "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    counted = await client.post(
        "/v1/responses/input_tokens", json={"model": "echo", "input": "hi", "tools": [responses_tool]}
    )
    assert (await counted.json())["input_tokens"] == len(tokenizer.encode(rendered))
    counted = await client.post(
        "/v1/messages/count_tokens",
        json={"model": "echo", "tools": [anthropic_tool], "messages": [{"role": "user", "content": "hi"}]},
    )
    assert (await counted.json())["input_tokens"] == len(tokenizer.encode(rendered))
    counted = await client.post("/v1/responses/input_tokens", json={"model": "echo", "input": "hi"})
    default = "[default]\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (await counted.json())["input_tokens"] == len(tokenizer.encode(default))


async def test_a_chosen_template_name_serves_requests_with_tools_too(aiohttp_client, tmp_path, named_dir):
    client = await _client(aiohttp_client, tmp_path, named_dir, 'models.echo.chat_template_name="default"')
    body = {"model": "echo", "messages": [{"role": "user", "content": CALL}], "tools": [WEATHER], "max_tokens": 200}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    message = (await resp.json())["choices"][0]["message"]
    assert _last_prompt(client).startswith("[default]\n<|im_start|>system")  # the tools in a system message
    assert message["content"] == CALL and not message.get("tool_calls")


def test_a_relayed_models_counter_renders_a_chat_with_tools_with_the_tool_use_template(named_dir):
    tokenizer = Tokenizer.from_dir(named_dir)
    counter = TokenizerCounter(tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    with_tools = counter.encode_chat(messages, tools=[WEATHER])
    assert tokenizer.decode(with_tools, skip_special_tokens=False).startswith("[tool_use] 0 tools")  # counted apart:
    assert tokenizer.decode(with_tools).endswith(orjson.dumps({"tools": [WEATHER]}).decode())
    assert tokenizer.decode(counter.encode_chat(messages), skip_special_tokens=False).startswith("[default]")
