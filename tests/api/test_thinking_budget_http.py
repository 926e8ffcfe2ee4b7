"""A thinking budget over HTTP, on the native engine with a reasoning model whose <think> and
</think> are single tokens (as Qwen3's) and whose template opens the thinking (as R1's): the
thinking is cut after the budget's tokens, the budget message and </think> follow, and the
model answers; chat completions (thinking_token_budget), the Messages API
(thinking.budget_tokens) and the model's own default (models.<name>.thinking_budget)."""

from __future__ import annotations

import json

import pytest

from api.app import init
from settings import ConfigError
from testing.tiny_model import build_tiny_llama
from tests.api.helpers import assert_error, echo_settings, native_settings, sse_events, state_of

# Thinking opened by the template (the prompt ends in <think>), stripped from history as R1's does.
R1_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{{ message['content'].split('</think>')[-1] }}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
MESSAGE = "\n\nI have to stop thinking here and give my answer now.\n"  # thinking_budget_message's default
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def reasoner_dir(tmp_path_factory):
    path = build_tiny_llama(tmp_path_factory.mktemp("reasoner") / "model", thinking_tags=True)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = R1_TEMPLATE
    cfg_file.write_text(json.dumps(cfg))
    return path


async def make_client(aiohttp_client, tmp_path, reasoner_dir, *extra: str):
    app = init(native_settings(tmp_path, reasoner_dir, extra=extra))
    return await aiohttp_client(app, server_kwargs={"handler_cancellation": True})


@pytest.fixture
async def client(aiohttp_client, tmp_path, reasoner_dir):
    return await make_client(aiohttp_client, tmp_path, reasoner_dir)


BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "What does the word river mean?"}],
    "temperature": 0,
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
}


async def chat(client, **extra) -> dict:
    resp = await client.post("/v1/chat/completions", json={**BODY, **extra})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def thinking_tokens(client) -> list[str]:
    """The unbudgeted answer's tokens as text (the model never closes its thinking in them)."""
    body = await chat(client, logprobs=True)
    message = body["choices"][0]["message"]
    assert message["content"] == "" and "</think>" not in message["reasoning_content"]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == MAX_TOKENS  # all of it thinking
    return [t["token"] for t in body["choices"][0]["logprobs"]["content"]]


async def test_the_thinking_is_cut_at_the_budget_then_the_model_answers(client):
    tokens = await thinking_tokens(client)
    body = await chat(client, thinking_token_budget=5)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == ("".join(tokens[:5]) + MESSAGE).lstrip()
    assert message["content"]  # the answer after </think>
    assert body["usage"]["completion_tokens"] == MAX_TOKENS  # forced tokens count as the model's
    # usage says how many were thinking: the budget's 5, the message and </think>
    num_message = len(state_of(client).models["tiny"].tokenizer.encode(MESSAGE))
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5 + num_message + 1
    streamed, _ = await sse_events(
        await client.post("/v1/chat/completions", json={**BODY, "stream": True, "thinking_token_budget": 5})
    )
    deltas = [e["choices"][0]["delta"] for e in streamed[:-1] if isinstance(e, dict) and e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


async def test_a_zero_budget_answers_without_thinking(client):
    message = (await chat(client, thinking_token_budget=0))["choices"][0]["message"]
    assert message["reasoning_content"] == MESSAGE.lstrip()
    assert message["content"]


async def test_the_messages_api_budget_tokens_cut_the_thinking_block(client):
    tokens = await thinking_tokens(client)
    body = {
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "messages": BODY["messages"],
        "thinking": {"type": "enabled", "budget_tokens": 3},
    }
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 200, await resp.text()
    blocks = (await resp.json())["content"]
    assert blocks[0] == {"type": "thinking", "thinking": ("".join(tokens[:3]) + MESSAGE).lstrip(), "signature": ""}


async def test_the_models_default_budget_applies_and_a_request_replaces_it(aiohttp_client, tmp_path, reasoner_dir):
    plain = await make_client(aiohttp_client, tmp_path, reasoner_dir)
    tokens = await thinking_tokens(plain)
    store = f'store.path="{tmp_path / "capped.db"}"'  # a second server: its own database
    extra = ("models.tiny.thinking_budget=2", 'models.tiny.thinking_budget_message=" Enough."', store)
    capped = await make_client(aiohttp_client, tmp_path, reasoner_dir, *extra)
    default = (await chat(capped))["choices"][0]["message"]["reasoning_content"]
    assert default == ("".join(tokens[:2]) + " Enough.").lstrip()
    replaced = (await chat(capped, thinking_token_budget=4))["choices"][0]["message"]["reasoning_content"]
    assert replaced == ("".join(tokens[:4]) + " Enough.").lstrip()


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"thinking_token_budget": -1}, "thinking_token_budget"),
        ("/v1/chat/completions", {"thinking_token_budget": "10"}, "thinking_token_budget"),
        ("/v1/responses", {"thinking_token_budget": 1.5}, "thinking_token_budget"),
    ],
)
async def test_a_bad_budget_is_a_400_naming_the_field_before_any_stream(client, path, body, param):
    base: dict = {"model": "tiny", "stream": True}
    if path == "/v1/responses":
        base.update(input="hi", max_output_tokens=8)
    else:
        base.update(messages=BODY["messages"], max_tokens=8)
    await assert_error(await client.post(path, json={**base, **body}), 400, param=param)


@pytest.mark.parametrize("budget", [-5, True, "3"])
async def test_a_bad_messages_budget_is_anthropics_400_naming_the_field(client, budget):
    body = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": BODY["messages"]}
    resp = await client.post("/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": budget}})
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and "thinking.budget_tokens" in error["message"]


async def test_a_model_whose_tags_are_not_single_tokens_refuses_a_budget(aiohttp_client, tmp_path, thinking_model_dir):
    from testing.fake_backend import fake_backends

    app = init(echo_settings(tmp_path, thinking_model_dir), backend_factory=fake_backends())
    client = await aiohttp_client(app)
    body = {"model": "echo", "messages": BODY["messages"], "thinking_token_budget": 8}
    await assert_error(await client.post("/v1/chat/completions", json=body), 400, param="thinking_token_budget")


async def test_a_model_that_does_not_think_ignores_a_budget(native_client):
    resp = await native_client.post("/v1/chat/completions", json={**BODY, "max_tokens": 4, "thinking_token_budget": 1})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "extra, message",
    [
        (("models.tiny.thinking_budget=-2",), "expected -1"),
        (("models.tiny.thinking_budget=10",), "does not think in <think> tags"),
    ],
)
def test_a_thinking_budget_the_model_cannot_take_is_a_config_error(tmp_path, tiny_model_dir, extra, message):
    from engine.registry import build_models

    with pytest.raises(ConfigError, match=message):
        build_models(native_settings(tmp_path, tiny_model_dir, extra=extra))


def test_a_relayed_model_takes_no_default_budget(tmp_path):
    from engine.registry import build_models
    from settings import load_settings

    settings = load_settings(
        None, ['models.up.backend="openai"', 'models.up.urls=["http://127.0.0.1:9/v1"]', "models.up.thinking_budget=5"]
    )
    with pytest.raises(ConfigError, match="only the native engine caps thinking"):
        build_models(settings)


async def test_the_responses_api_takes_the_budget_and_reports_the_reasoning_tokens(client):
    body = {"model": "tiny", "input": BODY["messages"][0]["content"], "max_output_tokens": MAX_TOKENS}
    body.update(temperature=0, thinking_token_budget=5, store=False)
    resp = await client.post("/v1/responses", json=body)
    assert resp.status == 200, await resp.text()
    usage = (await resp.json())["usage"]
    num_message = len(state_of(client).models["tiny"].tokenizer.encode(MESSAGE))
    assert usage["output_tokens_details"]["reasoning_tokens"] == 5 + num_message + 1
    assert usage["output_tokens"] > usage["output_tokens_details"]["reasoning_tokens"]


def test_a_trtllm_model_refuses_a_budget_and_the_messages_api_then_ignores_it(reasoner_dir):
    from dataclasses import replace

    from api.errors import ApiError
    from api.job import thinking_budget
    from api.protocol import parse_chat_request
    from engine.registry import ModelHandle
    from engine.tokenizer import Tokenizer
    from settings import ModelConfig

    tokenizer = Tokenizer.from_dir(reasoner_dir)
    raw = {"messages": BODY["messages"], "thinking_token_budget": 5}
    chat = parse_chat_request(raw, max_messages=4, max_prompt_chars=1000)

    def model(backend: str) -> ModelHandle:
        return ModelHandle("m", ModelConfig(path=str(reasoner_dir), backend=backend), None, tokenizer)  # type: ignore[arg-type]

    with pytest.raises(ApiError, match="TensorRT-LLM") as refused:
        thinking_budget(chat, model("trtllm"), True)
    assert (refused.value.status, refused.value.param) == (400, "thinking_token_budget")
    assert thinking_budget(replace(chat, thinking_budget_strict=False), model("trtllm"), True) is None
    native = thinking_budget(chat, model("native"), True)
    assert native is not None and native.opened and native.max_tokens == 5
    assert native.forced_ids == (*tokenizer.encode(MESSAGE), tokenizer.encode("</think>")[0])
    assert thinking_budget(chat, model("native"), None) is None  # a model that does not think


async def test_models_say_which_models_think_and_whether_their_thinking_can_be_capped(
    client, aiohttp_client, tmp_path, thinking_model_dir
):
    from testing.fake_backend import fake_backends

    entries = (await (await client.get("/v1/models")).json())["data"]
    assert entries[0]["reasoning"] == {"thinking_token_budget": True}
    echo = await aiohttp_client(
        init(echo_settings(tmp_path / "echo", thinking_model_dir), backend_factory=fake_backends())
    )
    by_id = {m["id"]: m for m in (await (await echo.get("/v1/models")).json())["data"]}
    assert by_id["echo"]["reasoning"] == {"thinking_token_budget": False}  # tags of several tokens


async def test_a_json_answer_comes_after_the_thinking(client):
    # The grammar constrains only what follows </think>: the model thinks (here 5 tokens, then
    # the budget closes it) and the content is the JSON the schema asks for.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {**schema, "additionalProperties": False}}}
    tokens = await thinking_tokens(client)
    body = await chat(client, thinking_token_budget=5, response_format=fmt, max_tokens=60, ignore_eos=False)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == ("".join(tokens[:5]) + MESSAGE).lstrip()
    assert json.loads(message["content"]) in ({"ok": True}, {"ok": False})
    assert body["choices"][0]["finish_reason"] == "stop"


def test_a_grammar_alone_follows_the_thinking_uncapped_on_the_native_engine(reasoner_dir):
    from dataclasses import replace

    from api.job import thinking_budget
    from api.protocol import parse_chat_request
    from engine.registry import ModelHandle
    from engine.tokenizer import Tokenizer
    from settings import ModelConfig

    tokenizer = Tokenizer.from_dir(reasoner_dir)
    chat = parse_chat_request({"messages": BODY["messages"]}, max_messages=4, max_prompt_chars=1000)

    def model(backend: str) -> ModelHandle:
        return ModelHandle("m", ModelConfig(path=str(reasoner_dir), backend=backend), None, tokenizer)  # type: ignore[arg-type]

    followed = thinking_budget(chat, model("native"), False, has_grammar=True)
    assert followed is not None and followed.max_tokens is None and followed.forced_ids == ()
    assert thinking_budget(chat, model("native"), False) is None  # no grammar, no budget: nothing to do
    assert thinking_budget(chat, model("trtllm"), False, has_grammar=True) is None
    assert thinking_budget(replace(chat, thinking_token_budget=3), model("native"), False).max_tokens == 3


async def test_a_tiers_thinking_cap_bounds_every_request_of_the_tier(
    aiohttp_client, tmp_path, reasoner_dir, thinking_model_dir
):
    from testing.fake_backend import fake_backends

    plain = await make_client(aiohttp_client, tmp_path, reasoner_dir)
    tokens = await thinking_tokens(plain)
    capped = await make_client(
        aiohttp_client,
        tmp_path,
        reasoner_dir,
        "tiers.enterprise.max_thinking_tokens=3",
        f'store.path="{tmp_path / "t.db"}"',
    )

    async def reasoning(**extra) -> str:
        return (await chat(capped, **extra))["choices"][0]["message"]["reasoning_content"]

    assert await reasoning() == ("".join(tokens[:3]) + MESSAGE).lstrip()  # keyless local use: enterprise
    assert await reasoning(thinking_token_budget=10) == ("".join(tokens[:3]) + MESSAGE).lstrip()  # the smaller
    assert await reasoning(thinking_token_budget=2) == ("".join(tokens[:2]) + MESSAGE).lstrip()
    # A model whose thinking cannot be capped here is served as it is (the cap is the tier's, not the caller's).
    settings = echo_settings(tmp_path / "echo", thinking_model_dir, ("tiers.enterprise.max_thinking_tokens=3",))
    echo = await aiohttp_client(init(settings, backend_factory=fake_backends()))
    resp = await echo.post("/v1/chat/completions", json={"model": "echo", "messages": BODY["messages"]})
    assert resp.status == 200, await resp.text()


async def test_metrics_count_the_thinking_tokens(client):
    usage = (await chat(client, thinking_token_budget=4))["usage"]
    thinking = usage["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < thinking < usage["completion_tokens"]
    text = await (await client.get("/metrics")).text()
    line = next(line for line in text.splitlines() if line.startswith("chat_reasoning_tokens_total{"))
    assert 'model="tiny"' in line and float(line.rsplit(" ", 1)[1]) == thinking
