"""A reasoning model over HTTP: <think> text in reasoning_content (stream and unary), and
chat_template_kwargs reaching the template (enable_thinking), validated before any stream."""

from __future__ import annotations

import json
import shutil

import pytest

from api.app import init
from testing.fake_backend import fake_backends
from testing.tiny_model import CHAT_TEMPLATE
from tests.api.helpers import assert_error, echo_settings, sse_events

THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)
# The echo backend answers with the last user message: this one plays a reasoning model.
THINKS = [{"role": "user", "content": "<think>\nCount the words.\n</think>\n\nThree words here."}]


@pytest.fixture
def thinking_model_dir(tiny_model_dir, tmp_path):
    target = tmp_path / "thinking"
    shutil.copytree(tiny_model_dir, target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    return target


@pytest.fixture
async def client(aiohttp_client, tmp_path, thinking_model_dir):
    return await aiohttp_client(init(echo_settings(tmp_path, thinking_model_dir), backend_factory=fake_backends()))


async def chat(client, **body):
    return await client.post("/v1/chat/completions", json={"model": "echo", "messages": THINKS, **body})


async def test_unary_answer_carries_the_thinking_in_reasoning_content(client):
    resp = await chat(client)
    assert resp.status == 200, await resp.text()
    message = (await resp.json())["choices"][0]["message"]
    assert message["reasoning_content"] == "Count the words.\n"
    assert message["content"] == "Three words here."


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
