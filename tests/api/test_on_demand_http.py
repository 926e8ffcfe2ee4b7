"""A model loaded on its first request and unloaded when idle (models.<name>.idle_unload_s),
over HTTP on the real native engine: nothing is loaded at start, the first request loads it
and gets the same answer as an always-loaded model, concurrent first requests share one load,
a running stream keeps it loaded, idleness unloads it (its engine freed) and the next request
loads it again, warm from the prefix cache its unload wrote."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from api.app import init
from settings import ConfigError
from tests.api.helpers import native_settings, state_of

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 8}
ASK = [SYSTEM, {"role": "user", "content": "What does river mean?"}]


async def ask(client, **extra) -> dict:
    body = {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 8, **extra}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def on_demand_client(aiohttp_client, tmp_path, model_dir, idle_s: float):
    settings = native_settings(tmp_path, model_dir, extra=(f"models.tiny.idle_unload_s={idle_s}",))
    client = await aiohttp_client(init(settings), server_kwargs={"handler_cancellation": True})
    return client, state_of(client).models["tiny"].backend


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    pytest.fail("the condition did not come true in time")


async def test_loaded_on_the_first_request_unloaded_when_idle_and_warm_when_it_comes_back(
    aiohttp_client, tmp_path, tiny_model_dir, native_client
):
    always = await ask(native_client)
    client, backend = await on_demand_client(aiohttp_client, tmp_path / "on-demand", tiny_model_dir, 0.3)
    assert not backend.is_loaded and backend.stats().num_kv_blocks_total == 0
    assert (await client.get("/ready")).status == 200  # an unloaded model is not a broken one

    async def listed_as_loaded() -> bool:
        return (await (await client.get("/v1/models")).json())["data"][0]["loaded"]

    assert await listed_as_loaded() is False
    first = await ask(client)
    assert await listed_as_loaded() is True
    assert first["choices"][0]["message"] == always["choices"][0]["message"]
    assert backend.is_loaded and backend.num_loads == 1
    engine = weakref.ref(backend.engine)
    await wait_until(lambda: backend.num_unloads == 1)  # is_loaded turns false when the unload begins
    assert not backend.is_loaded
    gc.collect()
    assert engine() is None, "the unloaded engine (weights, KV pool) is freed"
    again = await ask(client)
    assert backend.num_loads == 2 and again["choices"][0]["message"] == always["choices"][0]["message"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the unload kept its prefix cache


async def test_concurrent_first_requests_share_one_load(aiohttp_client, tmp_path, tiny_model_dir):
    client, backend = await on_demand_client(aiohttp_client, tmp_path, tiny_model_dir, 30)
    answers = await asyncio.gather(*(ask(client) for _ in range(3)))
    assert backend.num_loads == 1 and len({a["choices"][0]["message"]["content"] for a in answers}) == 1


async def test_a_running_stream_keeps_the_model_loaded(aiohttp_client, tmp_path, tiny_model_dir):
    client, backend = await on_demand_client(aiohttp_client, tmp_path, tiny_model_dir, 0.05)
    body = {"model": "tiny", "messages": ASK, "stream": True, "max_tokens": 300, "ignore_eos": True}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    lines = 0
    async for line in resp.content:  # the stream outlasts idle_unload_s many times over
        if line.startswith(b'data: {"') and b'"content"' in line and b'"content":""' not in line:  # a token
            lines += 1
            assert backend.is_loaded
    assert lines > 100 and backend.num_loads == 1
    await wait_until(lambda: not backend.is_loaded)


@pytest.mark.parametrize(
    "extra",
    [("models.tiny.idle_unload_s=-1",), ('models.tiny.backend="trtllm"', "models.tiny.idle_unload_s=5")],
)
def test_idle_unload_for_a_native_model_only_and_never_negative(tmp_path, tiny_model_dir, extra):
    from engine.registry import build_models

    with pytest.raises(ConfigError, match="idle_unload_s"):
        build_models(native_settings(tmp_path, tiny_model_dir, extra=extra))


async def test_a_client_that_leaves_frees_its_sequence_at_once(aiohttp_client, tmp_path, tiny_model_dir):
    client, backend = await on_demand_client(aiohttp_client, tmp_path, tiny_model_dir, 30)
    body = {"model": "tiny", "messages": ASK, "stream": True, "max_tokens": 300, "ignore_eos": True}
    resp = await client.post("/v1/chat/completions", json=body)
    async for line in resp.content:
        if b'"content":"' in line and b'"content":""' not in line:
            break  # the first token: the model is loaded and the sequence runs
    resp.close()
    await wait_until(lambda: backend.stats().num_running == 0 and backend.stats().num_waiting == 0)
    assert backend.is_loaded  # still loaded: idle_unload_s has not passed
