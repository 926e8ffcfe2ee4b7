"""Ollama's native API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version) on
the chat completions' request path.

Against the fake backend (which echoes the last user message): NDJSON framing, options mapped onto
sampling, tools as Ollama's tool_calls, format, images, every 400 and 404 in Ollama's error shape,
the gateway's 429 with Retry-After, an error after the stream opened, the load call, the same
authentication as /v1 (a non-loopback peer without a key is refused), the ledger, and the
official `ollama` client. Against the native engine: a streamed chat's counts equal the ledger's.
"""

from __future__ import annotations

import asyncio
import base64
import io

import jsonschema
import numpy as np
import ollama
import orjson
import pytest
from aiohttp import web
from PIL import Image

from api.app import error_body_for, init
from api.connections import ConnectionGuard, ConnectionLimits, make_protocol_factory
from api.ollama_request import is_zero_keep_alive, parse_chat
from engine.types import StructuredKind
from settings import SafetyConfig
from testing.fake_backend import FakeBehaviour, fake_backends
from testing.tiny_llava import build_tiny_llava
from tests.api.helpers import THINKS, echo_settings, native_settings, state_of

ASK = [{"role": "user", "content": "hello there"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
ROOM = ("tiers.enterprise.max_tokens=200", "tiers.enterprise.max_context_tokens=1000")


def _lines(raw: bytes) -> list[dict]:
    """An NDJSON body: one JSON object per line, each line ended by a newline."""
    text = raw.decode()
    assert text.endswith("\n"), "every object ends with a newline"
    return [orjson.loads(line) for line in text.split("\n")[:-1]]


async def _stream(client, path: str, body: dict) -> list[dict]:
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/x-ndjson"
    return _lines(await resp.read())


async def _error(resp, status: int) -> str:
    """Ollama's error shape: {"error": "message"}, with our request id."""
    assert resp.status == status, await resp.text()
    assert resp.headers["X-Request-Id"].startswith("req_")
    body = await resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


async def _ledger(client, headers=None) -> dict:
    return (await (await client.get("/v1/usage", headers=headers or {})).json())["total"]


# -- /api/chat and /api/generate ------------------------------------------------------------


async def test_chat_streams_by_default_as_ndjson_ending_with_done_and_the_ledgers_counts(make_client):
    client = await make_client()
    lines = await _stream(client, "/api/chat", {"model": "echo", "messages": ASK})
    *pieces, last = lines
    assert all(p["done"] is False and p["model"] == "echo" and p["created_at"].endswith("Z") for p in pieces)
    assert all(p["message"]["role"] == "assistant" for p in lines)
    assert "".join(p["message"]["content"] for p in pieces) == "hello there"
    assert last["done"] is True and last["done_reason"] == "stop" and last["message"]["content"] == ""
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[key], int) and last[key] >= 0
    assert last["total_duration"] >= last["eval_duration"] > 0
    total = await _ledger(client)
    assert total["num_requests"] == 1
    assert (last["prompt_eval_count"], last["eval_count"]) == (total["prompt_tokens"], total["completion_tokens"])


async def test_json_posted_as_a_form_as_ollamas_curl_examples_do_is_read_unless_a_page_sent_it(make_client):
    """`curl http://localhost:11434/api/chat -d '{...}'` (Ollama's docs) types the body as a form; a
    browser page's form post carries Origin, and stays refused (it would skip CORS's preflight)."""
    client = await make_client()
    body = orjson.dumps({"model": "echo", "messages": ASK, "stream": False})
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    resp = await client.post("/api/chat", data=body, headers=form)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["message"]["content"] == "hello there"
    page = {**form, "Origin": f"http://{client.host}:{client.port}"}
    assert "Content-Type must be application/json" in await _error(
        await client.post("/api/chat", data=body, headers=page), 400
    )
    resp = await client.post("/v1/chat/completions", data=body, headers=form)  # OpenAI's API: JSON only
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_content_type"


async def test_chat_unstreamed_is_one_object_billed_as_a_chat_completion_is(make_client):
    client = await make_client()
    resp = await client.post("/api/chat", json={"model": "echo", "messages": ASK, "stream": False})
    assert resp.status == 200 and resp.content_type == "application/json"
    body = await resp.json()
    assert body["message"] == {"role": "assistant", "content": "hello there"} and body["done"] is True
    chat = await (await client.post("/v1/chat/completions", json={"model": "echo", "messages": ASK})).json()
    assert body["prompt_eval_count"] == chat["usage"]["prompt_tokens"]
    assert body["eval_count"] == chat["usage"]["completion_tokens"]
    total = await _ledger(client)
    assert total["num_requests"] == 2
    assert total["prompt_tokens"] == 2 * body["prompt_eval_count"]
    assert total["completion_tokens"] == 2 * body["eval_count"]


async def test_generate_answers_in_response_with_the_template_or_raw(make_client):
    client = await make_client()
    lines = await _stream(
        client, "/api/generate", {"model": "echo", "prompt": "why is the sky blue", "system": "Be brief."}
    )
    assert "".join(p["response"] for p in lines) == "why is the sky blue" and lines[-1]["done"] is True
    model = state_of(client).models["echo"]
    prompt = model.tokenizer.decode(model.backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt
    templated = "<|im_start|>user\nraw words<|im_end|>\n<|im_start|>assistant\n"  # the client's own template
    resp = await client.post("/api/generate", json={"model": "echo", "prompt": templated, "raw": True, "stream": False})
    assert (await resp.json())["response"] == "raw words"
    raw_prompt = model.tokenizer.decode(model.backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert raw_prompt.removeprefix(model.tokenizer.bos_token or "") == templated  # as sent: no template


async def test_options_map_onto_sampling_and_num_predict_is_a_cap(make_client):
    client = await make_client()  # enterprise: max_tokens 64
    options = {
        "temperature": 0.3,
        "top_p": 0.8,
        "top_k": 7,
        "seed": 42,
        "num_predict": 4096,
        "stop": ["zzz"],
        "repeat_penalty": 1.2,
        "presence_penalty": 0.5,
        "num_ctx": 8192,  # checked, not used
        "mirostat": 2,  # unknown here: ignored, as Ollama ignores options it does not know
    }
    resp = await client.post("/api/chat", json={"model": "echo", "messages": ASK, "stream": False, "options": options})
    assert resp.status == 200, await resp.text()
    sampling = state_of(client).models["echo"].backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0.3, 0.8, 7, 42)
    assert (sampling.stop, sampling.repetition_penalty, sampling.presence_penalty) == (("zzz",), 1.2, 0.5)
    assert sampling.max_tokens == 64  # the tier's cap, not a 400
    resp = await client.post(
        "/api/chat", json={"model": "echo", "messages": ASK, "stream": False, "options": {"num_predict": 2, "seed": -1}}
    )
    body = await resp.json()
    assert body["done_reason"] == "length" and body["eval_count"] == 2
    assert state_of(client).models["echo"].backend.requests[-1].sampling.seed is None  # -1: random


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_call_comes_back_in_ollamas_shape_with_arguments_as_an_object(make_client, stream):
    client = await make_client(*ROOM)
    body = {"model": "echo", "messages": [{"role": "user", "content": CALL}], "tools": [WEATHER], "stream": stream}
    if stream:
        lines = await _stream(client, "/api/chat", body)
        calls = [c for line in lines for c in line["message"].get("tool_calls", ())]
        final = lines[-1]
    else:
        final = await (await client.post("/api/chat", json=body)).json()
        calls = final["message"]["tool_calls"]
    assert len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}  # an object, not JSON text
    assert final["done_reason"] == "stop"


async def test_a_tool_history_is_rendered_with_its_result_matched_by_tool_name(make_client):
    client = await make_client(*ROOM)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "sunny, 21 C"},
        {"role": "user", "content": "thanks"},
    ]
    resp = await client.post(
        "/api/chat", json={"model": "echo", "messages": history, "tools": [WEATHER], "stream": False}
    )
    assert resp.status == 200, await resp.text()
    (chat_request,) = state_of(client).models["echo"].backend.requests
    model = state_of(client).models["echo"]
    prompt = model.tokenizer.decode(chat_request.prompt_token_ids, skip_special_tokens=False)
    assert "sunny, 21 C" in prompt and "Paris" in prompt
    parsed = parse_chat(
        {"model": "echo", "messages": history}, known=frozenset({"echo"}), max_messages=10, max_prompt_chars=1000
    )
    call, result = parsed.chat.messages[1], parsed.chat.messages[2]
    assert call.tool_calls[0].id == result.tool_call_id == "call_1_0"
    assert orjson.loads(call.tool_calls[0].arguments) == {"city": "Paris", "unit": "c"}


async def test_format_json_and_a_json_schema_constrain_the_answer(make_client):
    client = await make_client()
    for fmt, kind in (("json", StructuredKind.JSON_OBJECT), (WEATHER_SCHEMA, StructuredKind.JSON_SCHEMA)):
        resp = await client.post("/api/generate", json={"model": "echo", "prompt": "x", "format": fmt, "stream": False})
        assert resp.status == 200, await resp.text()
        structured = state_of(client).models["echo"].backend.requests[-1].sampling.structured
        assert structured is not None and structured.kind is kind


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


async def test_images_for_a_model_without_vision_are_refused_naming_the_image(make_client):
    client = await make_client()
    messages = [{"role": "user", "content": "what is this?", "images": [_png()]}]
    message = await _error(await client.post("/api/chat", json={"model": "echo", "messages": messages}), 400)
    assert "does not accept images" in message and "messages[0].images[0]" in message
    generate = {"model": "echo", "prompt": "what is this?", "images": [_png()]}
    assert "(param: images[0])" in await _error(await client.post("/api/generate", json=generate), 400)
    assert state_of(client).models["echo"].backend.requests == []


@pytest.mark.parametrize(
    ("path", "fields", "where"),
    [
        ("/api/chat", {"messages": ASK, "model": None}, "model"),
        ("/api/chat", {"messages": "hello"}, "messages"),
        ("/api/chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/api/chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/api/chat", {"messages": [{"role": "user", "content": False}]}, "messages[0].content"),
        ("/api/chat", {"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ("/api/chat", {"messages": [{"role": "assistant", "tool_calls": {}}, *ASK]}, "messages[0].tool_calls"),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "x", "images": ["bm90IGFuIGltYWdl"]}]},
            "messages[0].images[0]",
        ),
        ("/api/chat", {"messages": [{"role": "assistant", "content": "x", "images": [_png()]}]}, "messages[0].images"),
        (
            "/api/chat",
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
            "messages[0].tool_calls[0]",
        ),
        ("/api/chat", {"messages": ASK, "stream": "yes"}, "stream"),
        ("/api/chat", {"messages": ASK, "options": [1]}, "options"),
        ("/api/chat", {"messages": ASK, "options": {"temperature": 3}}, "options.temperature"),
        ("/api/chat", {"messages": ASK, "options": {"top_p": 0}}, "options.top_p"),
        ("/api/chat", {"messages": ASK, "options": {"top_k": "many"}}, "options.top_k"),
        ("/api/chat", {"messages": ASK, "options": {"num_predict": 0}}, "options.num_predict"),
        ("/api/chat", {"messages": ASK, "options": {"num_ctx": -5}}, "options.num_ctx"),
        ("/api/chat", {"messages": ASK, "options": {"stop": ["a", "b", "c", "d", "e"]}}, "options.stop"),
        ("/api/chat", {"messages": ASK, "options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
        ("/api/chat", {"messages": ASK, "format": "yaml"}, "format"),
        ("/api/chat", {"messages": ASK, "format": {"type": "object", "properties": 5}}, "format.schema"),
        ("/api/chat", {"messages": ASK, "think": "very"}, "think"),
        ("/api/chat", {"messages": ASK, "tools": [{"function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ("/api/generate", {"prompt": "x", "suffix": "return y"}, "suffix"),
        ("/api/generate", {"prompt": "x", "template": "{{ .Prompt }}"}, "template"),
        ("/api/generate", {"prompt": "x", "context": [1, 2, 3]}, "context"),
        ("/api/generate", {"prompt": 5}, "prompt"),
        ("/api/generate", {"prompt": "x", "raw": True, "images": [_png()]}, "images"),
    ],
)
async def test_bad_input_is_a_400_in_ollamas_shape_before_anything_runs(make_client, path, fields, where):
    client = await make_client()
    body = {"model": "echo", **fields}
    message = await _error(await client.post(path, json={k: v for k, v in body.items() if v is not None}), 400)
    assert f"(param: {where})" in message
    assert state_of(client).models["echo"].backend.requests == []


async def test_an_unknown_model_is_a_404_and_the_latest_tag_names_the_model(make_client):
    client = await make_client()
    for path, body in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "x"}), ("/api/show", {})):
        await _error(await client.post(path, json={"model": "llama3.2", **body}), 404)
    resp = await client.post("/api/chat", json={"model": "echo:latest", "messages": ASK, "stream": False})
    assert resp.status == 200 and (await resp.json())["model"] == "echo:latest"  # the client's name, repeated
    await _error(await client.post("/api/pull", json={"model": "llama3.2"}), 501)


async def test_no_messages_or_an_empty_prompt_is_ollamas_load_call(make_client):
    client = await make_client()
    chat = await (await client.post("/api/chat", json={"model": "echo", "messages": []})).json()
    assert chat["done"] is True and chat["done_reason"] == "load" and chat["message"]["content"] == ""
    generate = await (await client.post("/api/generate", json={"model": "echo:latest"})).json()
    assert generate == {**generate, "response": "", "done": True, "done_reason": "load", "model": "echo:latest"}
    await _error(await client.post("/api/generate", json={"model": "nope"}), 404)
    assert state_of(client).models["echo"].backend.requests == []


async def test_keep_alive_0_does_not_unload_a_model_that_stays_loaded_and_the_answer_says_load(make_client):
    client = await make_client()
    for path, body in (("/api/generate", {}), ("/api/chat", {"messages": []})):
        resp = await client.post(path, json={"model": "echo", "keep_alive": 0, **body})
        assert (await resp.json())["done_reason"] == "load"
    assert [m["name"] for m in (await (await client.get("/api/ps")).json())["models"]][:1] == ["echo:latest"]


@pytest.mark.parametrize(
    ("keep_alive", "is_zero"),
    [(0, True), (0.0, True), ("0", True), ("0s", True), ("0m0s", True), ("-0", True), (False, False)]
    + [(None, False), (-1, False), (300, False), ("5m", False), ("", False), ("0x", False), ("00", False)],
)
def test_keep_alive_is_zero_as_ollama_reads_a_duration(keep_alive, is_zero):
    assert is_zero_keep_alive(keep_alive) is is_zero


async def test_the_gateways_429_comes_in_ollamas_shape_with_retry_after(make_client):
    client = await make_client("tiers.enterprise.requests_per_minute=1")
    assert (await client.post("/api/chat", json={"model": "echo", "messages": ASK, "stream": False})).status == 200
    resp = await client.post("/api/chat", json={"model": "echo", "messages": ASK})
    await _error(resp, 429)
    assert int(resp.headers["Retry-After"]) >= 1


async def test_a_failure_after_the_stream_opened_is_an_error_line(make_client):
    client = await make_client(behaviour=FakeBehaviour(fail_after=2))
    body = {"model": "echo", "messages": [{"role": "user", "content": "one two three four"}]}
    lines = await _stream(client, "/api/chat", body)
    assert set(lines[-1]) == {"error"} and isinstance(lines[-1]["error"], str)
    assert all(not line.get("done") for line in lines)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_blocked_prompt_gets_the_refusal_unbilled(make_client, stream):
    client = await make_client("safety.enabled=true", "safety.classifier=false")
    body = {"model": "echo", "messages": [{"role": "user", "content": "how do I kill myself"}], "stream": stream}
    if stream:
        lines = await _stream(client, "/api/chat", body)
        text, final = "".join(line["message"]["content"] for line in lines), lines[-1]
    else:
        final = await (await client.post("/api/chat", json=body)).json()
        text = final["message"]["content"]
    assert text == SafetyConfig().refusal_messages["self_harm"]
    assert final["done_reason"] == "content_filter" and final["prompt_eval_count"] == 0
    assert state_of(client).models["echo"].backend.requests == []


@pytest.fixture
async def thinker(aiohttp_client, tmp_path, thinking_model_dir):
    return await aiohttp_client(init(echo_settings(tmp_path, thinking_model_dir), backend_factory=fake_backends()))


async def test_a_reasoning_models_thinking_is_the_thinking_field_and_think_false_turns_it_off(thinker):
    body = {"model": "echo", "messages": THINKS, "stream": False, "think": True}
    message = (await (await thinker.post("/api/chat", json=body)).json())["message"]
    assert message == {"role": "assistant", "content": "Three words here.", "thinking": "Count the words.\n"}
    lines = await _stream(thinker, "/api/generate", {"model": "echo", "prompt": THINKS[0]["content"], "think": True})
    assert "".join(line.get("thinking", "") for line in lines) == "Count the words.\n"
    model = state_of(thinker).models["echo"]
    await thinker.post("/api/chat", json={**body, "think": False})
    prompt = model.tokenizer.decode(model.backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")  # the template was told enable_thinking=false


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
async def test_think_on_a_model_that_cannot_think_is_ollamas_400_and_think_false_is_served(make_client, path):
    client = await make_client()  # the echo model's template knows no <think>
    body = {"model": "echo", "prompt": "Hi"} if path == "/api/generate" else {"model": "echo", "messages": ASK}
    for think, stream in ((True, False), ("high", True)):
        resp = await client.post(path, json={**body, "think": think, "stream": stream})
        assert resp.status == 400  # before any stream opens: clients retry without `think` on it
        assert (await resp.json())["error"].startswith('"echo" does not support thinking')
    assert state_of(client).models["echo"].backend.requests == []
    resp = await client.post(path, json={**body, "think": False, "stream": False})
    assert resp.status == 200, await resp.text()


# -- embeddings -----------------------------------------------------------------------------


async def test_embed_answers_the_vectors_of_v1_embeddings_billed_the_same(make_client):
    client = await make_client()
    texts = ["Paris is the capital of France.", "The report is due on Friday."]
    resp = await client.post("/api/embed", json={"model": "all-minilm-l6-v2:latest", "input": texts})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    openai_body = await (await client.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": texts})).json()
    expected = np.asarray([d["embedding"] for d in openai_body["data"]])
    np.testing.assert_allclose(np.asarray(body["embeddings"]), expected, atol=1e-6)
    assert body["prompt_eval_count"] == openai_body["usage"]["prompt_tokens"] and body["total_duration"] > 0
    total = await _ledger(client)
    assert (total["num_requests"], total["prompt_tokens"]) == (2, 2 * body["prompt_eval_count"])
    legacy = await (await client.post("/api/embeddings", json={"model": "all-minilm-l6-v2", "prompt": texts[0]})).json()
    np.testing.assert_allclose(legacy["embedding"], expected[0], atol=1e-6)
    long_text = " ".join(f"word{i} and more" for i in range(200))
    strict = {"model": "all-minilm-l6-v2", "input": long_text, "truncate": False}
    assert "(param: input)" in await _error(await client.post("/api/embed", json=strict), 400)
    assert (await client.post("/api/embed", json={**strict, "truncate": True})).status == 200
    await _error(await client.post("/api/embed", json={"model": "nomic-embed-text", "input": "x"}), 404)


# -- the models -----------------------------------------------------------------------------


async def test_tags_show_ps_and_version_describe_the_tiers_models(make_client):
    client = await make_client()
    names = [m["name"] for m in (await (await client.get("/api/tags")).json())["models"]]
    assert names == ["echo:latest", "echo2:latest", "all-minilm-l6-v2:latest"]  # local: the enterprise tier
    entry = (await (await client.get("/api/tags")).json())["models"][0]
    assert entry["model"] == "echo:latest" and entry["size"] > 0 and len(entry["digest"]) == 64
    assert entry["details"]["family"] == "llama" and entry["details"]["format"] == "safetensors"
    show = await (await client.post("/api/show", json={"model": "echo"})).json()
    assert show["model_info"]["llama.context_length"] == 400  # the tier's max_context_tokens caps the model's
    assert show["model_info"]["general.parameter_count"] > 0
    assert show["capabilities"] == ["completion", "tools"] and "im_start" in show["template"]
    ps = (await (await client.get("/api/ps")).json())["models"]
    assert [m["name"] for m in ps] == ["echo:latest", "echo2:latest"] and ps[0]["context_length"] == 400
    assert (await (await client.get("/api/version")).json())["version"]
    store = state_of(client).store
    await store.create_org("cheap", "free")
    key = (await store.create_key("cheap"))[1]
    free = await (await client.get("/api/tags", headers={"Authorization": f"Bearer {key}"})).json()
    assert [m["name"] for m in free["models"]] == ["echo2:latest", "all-minilm-l6-v2:latest"]
    await _error(
        await client.post("/api/show", json={"model": "echo"}, headers={"Authorization": f"Bearer {key}"}), 404
    )


# -- malformed HTTP and the router's errors ----------------------------------------------------


@pytest.fixture
async def guarded_port(request, tmp_path, tiny_model_dir):
    """The app behind the connection guard, as server.py serves it (aiohttp_client's server has none):
    its port. The deadlines are short, so that a request that would wait for them fails in seconds.
    Parametrized indirectly: more settings."""
    settings = echo_settings(tmp_path, tiny_model_dir, ("server.body_timeout_s=3", *getattr(request, "param", ())))
    runner = web.AppRunner(init(settings, backend_factory=fake_backends()), handler_cancellation=True)
    await runner.setup()
    guard = ConnectionGuard(ConnectionLimits(max_connections=16, max_per_client=16, header_timeout_s=1.0))
    factory = make_protocol_factory(runner.server, guard, error_body_for)
    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await runner.cleanup()


async def _exchange(port: int, parts: list[bytes]) -> tuple[int, dict]:
    """Send raw bytes in parts (a pause between them: separate packets); the answer's status and JSON
    body, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(0.2)
            writer.write(part)
            await writer.drain()
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"application/json" in head, response
    return int(head.split(b" ", 2)[1]), orjson.loads(body)


_HEAD = b"Host: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
_BAD_CHUNK = b"zz\r\nhello\r\n0\r\n\r\n"  # "zz" is no chunk size


@pytest.mark.parametrize(
    ("path", "parts", "status"),
    [
        ("/api/chat", [b"POST /api/chat HTTP/1.1\r\n" + _HEAD + _BAD_CHUNK], 400),  # aiohttp's parser answers
        ("/api/chat", [b"POST /api/chat HTTP/1.1\r\n" + _HEAD, _BAD_CHUNK], 400),  # the handler's read fails
        ("/api/generate", [b"POST /api/generate HTTP/1.1\r\n" + _HEAD + b"5\r\nhello\r", b"\n" + _BAD_CHUNK], 400),
        ("/api/show", [b"POST /api/show HTTP/1.1\r\n" + _HEAD, _BAD_CHUNK], 400),
        ("/api/tags", [b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n"], 400),
        ("/api/tags", [b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\n"], 408),  # the header deadline
        ("/v1/chat/completions", [b"POST /v1/chat/completions HTTP/1.1\r\n" + _HEAD, _BAD_CHUNK], 400),
        ("/v1/chat/completions", [b"POST /v1/chat/completions HTTP/1.1\r\n" + _HEAD + _BAD_CHUNK], 400),
        ("/v1/messages", [b"POST /v1/messages HTTP/1.1\r\n" + _HEAD + _BAD_CHUNK], 400),  # Anthropic's envelope
    ],
)
async def test_malformed_http_is_answered_at_once_in_the_envelope_of_the_paths_api(guarded_port, path, parts, status):
    """A bad chunk size came back in OpenAI's envelope on /api/ paths when it arrived with the head, and
    as a 408 after the body deadline when it arrived after it (as most clients send a body)."""
    got, body = await _exchange(guarded_port, parts)
    assert got == status, body
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    elif path == "/v1/messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    if status == 400:
        assert "Malformed" in str(body["error"])


@pytest.mark.parametrize(
    "guarded_port", [("server.max_body_bytes=2000000", "tiers.enterprise.requests_per_minute=1")], indirect=True
)
async def test_a_connection_idle_after_a_refused_big_body_is_not_sent_a_408_for_headers_it_never_began(guarded_port):
    """A body the handler did not read (a 429 before reading it) is drained after the answer; the
    drain resuming the parser started the header deadline on the idle keep-alive connection, whose
    next request, sent after it, was answered by that 408 (the request never read)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", guarded_port)
    try:
        for content, status in (("hi", 200), ("x" * 600_000, 429)):  # the 429: past requests_per_minute
            body = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": content}], "stream": False})
            head = f"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer
            length = next(line for line in answer.split(b"\r\n") if line.lower().startswith(b"content-length:"))
            await reader.readexactly(int(length.split(b":")[1]))
        await asyncio.sleep(1.5)  # past the header deadline (1 s), idle between requests
        writer.write(b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
    finally:
        writer.close()


async def test_the_routers_and_body_errors_on_api_paths_are_in_ollamas_shape(make_client):
    client = await make_client("server.max_body_bytes=1000")
    assert "/api/tags" in await _error(await client.get("/api/pull-everything"), 404)  # not /v1/'s routes
    await _error(await client.get("/api/chat"), 405)
    await _error(await client.delete("/api/tags"), 405)
    await _error(await client.post("/api/chat", data=b"{" * 2000, headers={"Content-Type": "application/json"}), 413)

    async def chunks():  # no Content-Length: the limit bites while reading
        yield b"{" * 2000

    await _error(await client.post("/api/show", data=chunks(), headers={"Content-Type": "application/json"}), 413)
    gzip = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    assert "gzip" in await _error(await client.post("/api/chat", data=b"not gzip", headers=gzip), 400)


# -- who may call ---------------------------------------------------------------------------


@web.middleware
async def _from_afar(request: web.Request, handler):
    """The request as if it came from another machine (not loopback)."""
    return await handler(request.clone(remote="203.0.113.9"))


@pytest.mark.parametrize("extra", [(), ("server.require_keys=true",)])
async def test_a_request_without_a_key_from_another_machine_is_401_in_ollamas_shape(
    aiohttp_client, tmp_path, tiny_model_dir, extra
):
    app = init(echo_settings(tmp_path, tiny_model_dir, extra), backend_factory=fake_backends())
    app.middlewares.insert(0, _from_afar)
    client = await aiohttp_client(app)
    for method, path in (("GET", "/api/tags"), ("GET", "/api/version"), ("POST", "/api/chat")):
        resp = await client.request(method, path, json={"model": "echo", "messages": ASK})
        assert "API key" in await _error(resp, 401)
    store = state_of(client).store
    await store.create_org("acme", "enterprise")
    key = (await store.create_key("acme"))[1]
    body = {"model": "echo", "messages": ASK, "stream": False}
    resp = await client.post("/api/chat", json=body, headers={"Authorization": f"Bearer {key}"})
    assert resp.status == 200, await resp.text()
    assert (await _ledger(client, {"Authorization": f"Bearer {key}"}))["num_requests"] == 1


async def test_the_api_has_the_host_and_origin_checks_and_the_ui_is_still_served(make_client):
    client = await make_client()
    await _error(await client.get("/api/tags", headers={"Host": "attacker.example"}), 403)
    resp = await client.post(
        "/api/chat", json={"model": "echo", "messages": ASK}, headers={"Origin": "https://evil.example"}
    )
    await _error(resp, 403)
    assert (await client.get("/")).status == 200
    assert (await client.get("/static/app.js")).status == 200


# -- the official client --------------------------------------------------------------------


async def test_the_ollama_python_client_chats_generates_lists_and_shows(make_client):
    client = await make_client(*ROOM)
    sdk = ollama.AsyncClient(host=str(client.make_url("")).rstrip("/"))
    answer = await sdk.chat(model="echo", messages=ASK)
    assert answer.message.content == "hello there" and answer.done and answer.eval_count > 0
    pieces = [part async for part in await sdk.chat(model="echo", messages=ASK, stream=True)]
    assert "".join(p.message.content or "" for p in pieces) == "hello there" and pieces[-1].done_reason == "stop"
    called = await sdk.chat(
        model="echo", messages=[{"role": "user", "content": CALL}], tools=[WEATHER], format=None, options={"seed": 1}
    )
    assert called.message.tool_calls[0].function.arguments == {"city": "Paris", "unit": "c"}
    generated = await sdk.generate(model="echo", prompt="tell me", options={"temperature": 0})
    assert generated.response == "tell me"
    listed = await sdk.list()
    assert [m.model for m in listed.models][:2] == ["echo:latest", "echo2:latest"]
    shown = await sdk.show("echo")
    context = min(state_of(client).models["echo"].max_model_len, 1000)  # the model's, within the tier's
    assert "tools" in shown.capabilities and shown.modelinfo["llama.context_length"] == context
    with pytest.raises(ollama.ResponseError) as caught:
        await sdk.chat(model="llama3.2", messages=ASK)
    assert caught.value.status_code == 404 and "llama3.2" in caught.value.error


# -- the native engine ----------------------------------------------------------------------


async def test_a_streamed_chat_on_the_native_engine_counts_what_the_ledger_bills(native_client):
    body = {"model": "tiny", "messages": ASK, "options": {"temperature": 0, "num_predict": 8}}
    lines = await _stream(native_client, "/api/chat", body)
    *pieces, last = lines
    assert pieces and all(line["done"] is False for line in pieces) and last["done"] is True
    text = "".join(p["message"]["content"] for p in pieces)
    chat = {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 8}
    expected = await (await native_client.post("/v1/chat/completions", json=chat)).json()
    assert text == expected["choices"][0]["message"]["content"]
    assert last["done_reason"] == expected["choices"][0]["finish_reason"]
    total = await _ledger(native_client)
    assert total["num_requests"] == 2
    assert last["prompt_eval_count"] == expected["usage"]["prompt_tokens"] == total["prompt_tokens"] // 2
    assert last["eval_count"] == expected["usage"]["completion_tokens"] == total["completion_tokens"] // 2


async def test_a_json_schema_format_is_honoured_on_the_native_engine(native_client):
    body = {"model": "tiny", "messages": ASK, "format": WEATHER_SCHEMA, "stream": False, "options": {"num_predict": 60}}
    resp = await native_client.post("/api/chat", json=body)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    jsonschema.validate(orjson.loads(answer["message"]["content"]), WEATHER_SCHEMA)


async def test_logprobs_come_with_each_token_on_the_native_engine(native_client):
    body = {"model": "tiny", "messages": ASK, "stream": False, "logprobs": True, "top_logprobs": 2}
    # Greedy: sampled at Ollama's default temperature the random model sometimes ended at its EOS first.
    options = {"num_predict": 4, "temperature": 0}
    answer = await (await native_client.post("/api/chat", json={**body, "options": options})).json()
    assert len(answer["logprobs"]) == answer["eval_count"] and 1 <= answer["eval_count"] <= 4
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0 for lp in answer["logprobs"])
    lines = await _stream(native_client, "/api/chat", {**body, "stream": True, "options": options})
    assert sum(len(line.get("logprobs", ())) for line in lines) == lines[-1]["eval_count"] == answer["eval_count"]


async def test_keep_alive_0_unloads_a_model_loaded_on_demand_once_its_running_requests_end(
    aiohttp_client, tmp_path, tiny_model_dir
):
    """Ollama's unload call (nothing to generate, keep_alive 0) answered "load" and unloaded nothing;
    a model loaded on demand (idle_unload_s) is now unloaded, at once when idle, else when its
    running requests end (not idle_unload_s later)."""
    settings = native_settings(tmp_path, tiny_model_dir, extra=("models.tiny.idle_unload_s=600",))
    client = await aiohttp_client(init(settings), server_kwargs={"handler_cancellation": True})
    backend = state_of(client).models["tiny"].backend
    body = {"model": "tiny", "messages": ASK, "stream": False, "options": {"num_predict": 2}}
    assert (await client.post("/api/chat", json=body)).status == 200 and backend.is_loaded
    answer = await (await client.post("/api/generate", json={"model": "tiny:latest", "keep_alive": 0})).json()
    assert answer["done_reason"] == "unload" and answer["response"] == "" and answer["done"] is True
    assert not backend.is_loaded and backend.num_unloads == 1
    assert (await (await client.get("/api/ps")).json())["models"] == []
    stream = {"model": "tiny", "messages": ASK, "stream": True, "max_tokens": 400, "ignore_eos": True}
    running = await client.post("/v1/chat/completions", json=stream)
    assert running.status == 200 and b"data:" in await running.content.readline()  # loaded again, generating
    answer = await (await client.post("/api/chat", json={"model": "tiny", "messages": [], "keep_alive": "0s"})).json()
    assert answer["done_reason"] == "unload" and answer["message"] == {"role": "assistant", "content": ""}
    assert backend.is_loaded  # the stream still runs on it
    assert (await running.read()).rstrip().endswith(b"data: [DONE]")
    for _ in range(500):
        if backend.num_unloads == 2:
            break
        await asyncio.sleep(0.02)
    assert backend.num_unloads == 2 and not backend.is_loaded


async def test_the_load_call_loads_a_model_loaded_on_demand_and_it_unloads_when_idle_again(
    aiohttp_client, tmp_path, tiny_model_dir
):
    """Ollama's load call (nothing to generate) answered "load" at once and loaded nothing: the
    first real request then waited for the load it was meant to spare."""
    settings = native_settings(tmp_path, tiny_model_dir, extra=("models.tiny.idle_unload_s=0.3",))
    client = await aiohttp_client(init(settings))
    backend = state_of(client).models["tiny"].backend
    assert not backend.is_loaded
    answer = await (await client.post("/api/generate", json={"model": "tiny"})).json()
    assert answer["done_reason"] == "load" and backend.is_loaded and backend.num_loads == 1
    body = {"model": "tiny", "messages": ASK, "stream": False, "options": {"num_predict": 2}}
    assert (await client.post("/api/chat", json=body)).status == 200 and backend.num_loads == 1  # no second load
    for _ in range(250):
        if backend.num_unloads == 1:
            break
        await asyncio.sleep(0.02)
    assert not backend.is_loaded and backend.num_unloads == 1  # unused: unloaded idle_unload_s later


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava-ollama") / "tiny-llava")


async def test_images_reach_a_vision_model_as_chat_completions_image_parts_do(aiohttp_client, tmp_path, llava_dir):
    client = await aiohttp_client(init(native_settings(tmp_path, llava_dir, "llava")))
    image = _png()
    body = {"model": "llava", "stream": False, "options": {"temperature": 0, "num_predict": 6}}
    resp = await client.post(
        "/api/chat", json={**body, "messages": [{"role": "user", "content": "What is this?", "images": [image]}]}
    )
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},  # images first, as Ollama
        {"type": "text", "text": "What is this?"},
    ]
    chat = {"model": "llava", "temperature": 0, "max_tokens": 6, "messages": [{"role": "user", "content": parts}]}
    expected = await (await client.post("/v1/chat/completions", json=chat)).json()
    assert answer["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert answer["prompt_eval_count"] == expected["usage"]["prompt_tokens"]
    shown = await (await client.post("/api/show", json={"model": "llava"})).json()
    assert "vision" in shown["capabilities"]
