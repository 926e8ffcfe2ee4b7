"""Model folders as users bring them, on the real native engine: a broken folder stops the
server with one line naming the problem (checked for every model before any loads), a base
model without a chat template serves /v1/completions only, and a model loaded on demand whose
checkpoint is broken answers a 503 naming it."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from api.app import init
from settings import ConfigError
from tests.api.helpers import assert_error, native_settings, sse_events, state_of


def _copy(tiny_model_dir, tmp_path, name: str, **config_changes):
    folder = tmp_path / name
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"model_type": "mixtral"}, "model_type 'mixtral' is not one of"),
        ({"hidden_act": "relu2"}, "relu2"),
        (  # an FP8 release (Qwen3-*-FP8): its weights were cast without their scales and answered NaN
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
            "pre-quantized checkpoint .*'fp8'",
        ),
    ],
)
def test_an_unsupported_config_is_a_config_error_before_anything_loads(tiny_model_dir, tmp_path, changes, needle):
    from engine.registry import build_models

    bad = _copy(tiny_model_dir, tmp_path, "bad", **changes)
    settings = native_settings(tmp_path, tiny_model_dir, extra=(f'models.bad.path="{bad}"',))
    with pytest.raises(ConfigError, match=needle) as exc:
        build_models(settings)
    assert str(exc.value).startswith("models.bad: ")


def test_missing_or_unreadable_weights_are_a_config_error(tiny_model_dir, tmp_path):
    from engine.registry import build_models

    bad = _copy(tiny_model_dir, tmp_path, "bad")
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    settings = native_settings(tmp_path, bad, name="bad")
    with pytest.raises(ConfigError, match="cannot read safetensors"):
        build_models(settings)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no model\.safetensors"):
        build_models(settings)
    (bad / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin weights are not read"):
        build_models(settings)


async def test_tensors_that_do_not_match_config_json_stop_the_start_with_a_config_error(
    aiohttp_client, tiny_model_dir, tmp_path
):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    bad = _copy(tiny_model_dir, tmp_path, "bad", intermediate_size=config["intermediate_size"] * 2)
    with pytest.raises(ConfigError, match=r"models\.bad: .*has shape"):
        await aiohttp_client(init(native_settings(tmp_path, bad, name="bad")))


async def test_a_base_model_serves_completions_and_refuses_chat_naming_the_model(
    aiohttp_client, tiny_model_dir, tmp_path
):
    base = _copy(tiny_model_dir, tmp_path, "base")
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    client = await aiohttp_client(init(native_settings(tmp_path, base, name="base")))
    assert not state_of(client).models["base"].serves_chat
    # ignore_eos: a random model may pick its end token within 4 (it did once in a full run)
    body = {"model": "base", "prompt": "The river", "max_tokens": 4, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["usage"]["completion_tokens"] == 4
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/responses", {"input": "hi"}),
    ):
        await assert_error(await client.post(path, json={"model": "base", **body}), 400, code="model_not_chat")
    # An Ollama client is told the way its own API reaches a base model, not only /v1/completions.
    resp = await client.post("/api/generate", json={"model": "base", "prompt": "The river", "stream": False})
    assert resp.status == 400 and '/api/generate with "raw": true' in (await resp.json())["error"]
    raw = {"model": "base", "prompt": "The river", "raw": True, "stream": False, "options": {"num_predict": 2}}
    resp = await client.post("/api/generate", json=raw)
    assert resp.status == 200, await resp.text()
    listed = (await (await client.get("/v1/models")).json())["data"]
    assert listed[0]["id"] == "base" and listed[0]["chat"] is False


async def test_a_model_loaded_on_demand_that_cannot_load_is_a_503_naming_it(aiohttp_client, tiny_model_dir, tmp_path):
    """Not "failed while generating": a plain 503 (a stream, which sends heartbeats while the
    model loads, ends with that error and no [DONE]); the next request tries the load again."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    bad = _copy(tiny_model_dir, tmp_path, "bad", intermediate_size=config["intermediate_size"] * 2)
    settings = native_settings(tmp_path, bad, extra=("models.tiny.idle_unload_s=30",))
    client = await aiohttp_client(init(settings))  # nothing is loaded at start: the shapes are not read yet
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    resp = await client.post("/v1/chat/completions", json=body)
    await assert_error(resp, 503, code="model_load_failed")
    assert "Retry-After" in resp.headers and "'tiny' could not be loaded" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    events, _ = await sse_events(resp)
    assert events[-1] != "[DONE]" and events[-1]["error"]["code"] == "model_load_failed"
    resp = await client.post("/api/generate", json={"model": "tiny"})  # Ollama's load call: the same 503
    assert resp.status == 503 and "'tiny' could not be loaded" in (await resp.json())["error"]
    assert state_of(client).models["tiny"].backend.num_loads == 0
    assert (await client.get("/health")).status == 200


async def test_requests_waiting_for_a_load_that_fails_all_get_its_503_and_it_is_not_tried_again_for_each(
    aiohttp_client, tiny_model_dir, tmp_path, monkeypatch
):
    """Each request that waited for a failing load tried the load again once it got its turn: ten
    waiting for a load that fails after a minute waited ten minutes for the last 503."""
    from engine.native.backend import NativeBackend

    config = json.loads((tiny_model_dir / "config.json").read_text())
    bad = _copy(tiny_model_dir, tmp_path, "bad", intermediate_size=config["intermediate_size"] * 2)
    client = await aiohttp_client(init(native_settings(tmp_path, bad, extra=("models.tiny.idle_unload_s=30",))))
    start, num_tries = NativeBackend.start, 0

    async def slow_start(self) -> None:
        nonlocal num_tries
        num_tries += 1
        await asyncio.sleep(0.3)  # the requests below arrive while it loads
        await start(self)

    monkeypatch.setattr(NativeBackend, "start", slow_start)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    calls = [client.post("/v1/chat/completions", json=chat) for _ in range(3)]
    calls += [client.post("/api/generate", json={"model": "tiny"}) for _ in range(2)]  # Ollama's load call
    assert [r.status for r in await asyncio.gather(*calls)] == [503] * 5
    assert num_tries == 1
    await assert_error(await client.post("/v1/chat/completions", json=chat), 503, code="model_load_failed")
    assert num_tries == 2  # a request after the failure tries again


async def test_tokens_a_fine_tune_added_without_resizing_the_model_never_take_the_engine_down(
    aiohttp_client, tiny_model_dir, tmp_path
):
    """A tokenizer with more tokens than the model's embeddings: text holding an added token was
    an IndexError in a step (three of them killed the engine for everyone), and any JSON
    response_format killed the step thread at once (the grammar's vocabulary check)."""
    from tokenizers import AddedToken, Tokenizer

    added = _copy(tiny_model_dir, tmp_path, "added")
    tokenizer = Tokenizer.from_file(str(added / "tokenizer.json"))
    vocab_size = json.loads((added / "config.json").read_text())["vocab_size"]
    num_more = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True) + 2
    tokenizer.add_tokens([AddedToken(f"<note{i}>", special=False, normalized=False) for i in range(num_more)])
    tokenizer.save(str(added / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size + 2
    client = await aiohttp_client(init(native_settings(tmp_path, added, name="added")))
    beyond = f"<note{num_more - 1}>"
    for _ in range(4):  # more than the engine's consecutive failed steps
        resp = await client.post("/v1/completions", json={"model": "added", "prompt": f"a {beyond} b", "max_tokens": 3})
        await assert_error(resp, 400, param="messages")
    fmt = {"type": "json_object"}
    chat = {"model": "added", "messages": [{"role": "user", "content": "json"}], "max_tokens": 8}
    resp = await client.post("/v1/chat/completions", json={**chat, "response_format": fmt})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/chat/completions", json=chat)  # the engine still serves everyone
    assert resp.status == 200, await resp.text()


# Gemma 2's template, shortened: it refuses the system role and roles that do not alternate.
_GEMMA2_LIKE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<turn>{{ m['role'] }}\n{{ m['content'] }}</turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<turn>model\n{% endif %}"
)


def _with_template(tiny_model_dir, tmp_path, name: str, template: str):
    folder = _copy(tiny_model_dir, tmp_path, name)
    (folder / "chat_template.jinja").write_text(template)
    return folder


async def test_a_template_that_refuses_the_system_role_reads_it_in_the_first_user_turn(
    aiohttp_client, tiny_model_dir, tmp_path
):
    """Gemma 2 refuses a system message with raise_exception: every OpenAI client's system prompt
    was a 500. It now goes at the head of the first user turn (as Gemma 3's template puts it)."""
    from api.prompt import encode_chat
    from api.protocol import ChatMessage

    folder = _with_template(tiny_model_dir, tmp_path, "g2", _GEMMA2_LIKE)
    client = await aiohttp_client(init(native_settings(tmp_path, folder, name="g2")))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for path, body in (
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 3}),
        ("/v1/responses", {"instructions": "Be brief.", "input": "hi", "max_output_tokens": 3}),
        ("/v1/messages", {"system": "Be brief.", "messages": messages[1:], "max_tokens": 3}),
    ):
        resp = await client.post(path, json={"model": "g2", **body})
        assert resp.status == 200, (path, await resp.text())
    model = state_of(client).models["g2"]
    ids = encode_chat(model, [ChatMessage("system", "Be brief."), ChatMessage("user", "hi")])
    assert ids == model.tokenizer.encode_chat([{"role": "user", "content": "Be brief.\n\nhi"}])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_messages_a_template_refuses_are_a_400_in_its_words(aiohttp_client, tiny_model_dir, tmp_path, path):
    folder = _with_template(tiny_model_dir, tmp_path, "g2", _GEMMA2_LIKE)
    client = await aiohttp_client(init(native_settings(tmp_path, folder, name="g2")))
    two_users = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    resp = await client.post(path, json={"model": "g2", "max_tokens": 3, "messages": two_users})
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]  # OpenAI's envelope, or Anthropic's on /v1/messages
    assert "Conversation roles must alternate" in error["message"] and "'g2'" in error["message"]
    assert error.get("param", "messages") == "messages"


async def test_a_template_that_breaks_on_the_messages_is_a_400_not_a_500(aiohttp_client, tiny_model_dir, tmp_path):
    """A template bug (an undefined name's attribute, jinja's range limit) on these messages: a 400
    naming the messages and quoting the error, logged for the operator; "" as a template is none."""
    broken = "{% for m in messages %}{{ m.content }}{{ nothing.there }}{% endfor %}"
    folder = _with_template(tiny_model_dir, tmp_path, "broken", broken)
    client = await aiohttp_client(init(native_settings(tmp_path, folder, name="broken")))
    body = {"model": "broken", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    error = await assert_error(await client.post("/v1/chat/completions", json=body), 400, param="messages")
    assert "cannot render these messages" in error["message"] and "nothing" in error["message"]
    resp = await client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"x": 1}})
    await assert_error(resp, 400, param="messages")  # not the kwargs: the messages fail without them too
    empty = _with_template(tiny_model_dir, tmp_path, "empty", "  \n")
    (tmp_path / "second").mkdir()
    client = await aiohttp_client(init(native_settings(tmp_path / "second", empty, name="empty")))
    assert not state_of(client).models["empty"].serves_chat
    resp = await client.post("/v1/chat/completions", json={**body, "model": "empty"})
    await assert_error(resp, 400, code="model_not_chat")


def test_named_chat_templates_without_a_default_stop_the_start_unless_the_model_chooses_one(tiny_model_dir, tmp_path):
    from engine.registry import build_models

    folder = _copy(tiny_model_dir, tmp_path, "named")
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = [{"name": "tool_use", "template": "[tool_use]" + tok_config["chat_template"]}]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    with pytest.raises(ConfigError, match=r"^models\.named: .*none of them 'default'.*chat_template_name"):
        build_models(native_settings(tmp_path, folder, name="named"))
    chosen = native_settings(tmp_path, folder, name="named", extra=('models.named.chat_template_name="tool_use"',))
    tokenizer = build_models(chosen)["named"].tokenizer
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("[tool_use]")


def test_gguf_a_file_or_a_repo_id_given_as_a_model_folder_says_what_to_give_instead(tiny_model_dir, tmp_path):
    from api.startup import check_model_folders

    def problem(path) -> str:
        with pytest.raises(ConfigError) as info:
            check_model_folders(native_settings(tmp_path, path, name="m"))
        assert str(info.value).startswith("models.m.path: ")
        return str(info.value)

    gguf = tmp_path / "tinyllama.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    assert (
        "is a GGUF file; GGUF is not served as it is: turn it into a model folder with `server.py import-gguf"
        in problem(gguf)
    )
    blob = tmp_path / "sha256-6a0746a1ec1a"  # an Ollama blob: GGUF without the suffix
    blob.write_bytes(b"GGUF" + bytes(100))
    assert "sha256-6a0746a1ec1a is a GGUF file" in problem(blob) and "import-gguf" in problem(blob)
    gguf_only = tmp_path / "gguf-only"
    shutil.copytree(tiny_model_dir, gguf_only)  # was: "tokenizer.json: missing", or the weights' absence
    (gguf_only / "model.safetensors").unlink()
    (gguf_only / "model-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(100))
    assert "holds GGUF weights only (model-Q4_K_M.gguf)" in problem(gguf_only)
    assert "is a file, not a folder" in problem(tiny_model_dir / "config.json")
    repo_id = problem(tmp_path / "Qwen" / "Qwen3-0.6B")  # a relative "Qwen/Qwen3-0.6B", resolved
    assert "downloads nothing" in repo_id and "hf download Qwen/Qwen3-0.6B --local-dir models/Qwen3-0.6B" in repo_id
    assert "repo id" not in problem(tmp_path / "no-such-model")  # its folder exists: a plain missing folder


def test_a_config_json_that_is_not_utf8_is_a_config_error(tiny_model_dir, tmp_path):
    from engine.registry import build_models

    bad = _copy(tiny_model_dir, tmp_path, "bad")
    (bad / "config.json").write_bytes(b"\xff\xfe{\x00}")  # UTF-16 with its byte order mark
    with pytest.raises(ConfigError, match=r"config\.json: cannot parse JSON: 'utf-8' codec can't decode"):
        build_models(native_settings(tmp_path, bad, name="bad"))


def test_a_context_too_long_to_size_up_front_stops_the_start_unless_max_model_len_is_set(tiny_model_dir, tmp_path):
    from engine.registry import build_models

    huge = _copy(tiny_model_dir, tmp_path, "huge", max_position_embeddings=10**9)  # was: 32 GB of rope tables
    with pytest.raises(ConfigError, match=r"models\.huge: .*max_position_embeddings 1000000000 .*max_model_len"):
        build_models(native_settings(tmp_path, huge, name="huge"))
    models = build_models(native_settings(tmp_path, huge, name="huge", extra=("models.huge.max_model_len=256",)))
    assert models["huge"].max_model_len == 256


def test_a_model_with_no_eos_token_anywhere_is_served_with_a_warning_naming_it(tiny_model_dir, tmp_path):
    """Every answer runs to max_tokens: say so at start, not after the first long answer."""
    from structlog.testing import capture_logs

    from engine.registry import build_models

    folder = _copy(tiny_model_dir, tmp_path, "no-eos")
    for name, key in (("config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token")):
        cfg = json.loads((folder / name).read_text())
        cfg.pop(key, None)
        (folder / name).write_text(json.dumps(cfg))
    generation = folder / "generation_config.json"
    if generation.exists():
        cfg = json.loads(generation.read_text())
        cfg.pop("eos_token_id", None)
        generation.write_text(json.dumps(cfg))
    with capture_logs() as logs:
        build_models(native_settings(tmp_path, folder, name="no-eos"))
    warnings = [line for line in logs if line["event"] == "model_without_eos_token"]
    assert len(warnings) == 1 and warnings[0]["model"] == "no-eos"
    assert "generation_config.json" in warnings[0]["detail"] and "tokenizer_config.json" in warnings[0]["detail"]
    with capture_logs() as logs:
        build_models(native_settings(tmp_path, tiny_model_dir))
    assert not [line for line in logs if line["event"] == "model_without_eos_token"]
