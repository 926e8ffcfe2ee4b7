"""The server over the real native engine (tiny model): prefix caching seen by clients.

The next turn of a conversation reuses the previous turn's KV blocks (cached_tokens > 0),
and the cache is salted per organisation: another org's identical prompt misses.
"""

from __future__ import annotations

import pytest

from tests.api.helpers import state_of

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 8}


@pytest.fixture
def client(native_client):
    return native_client


async def ask(client, messages, headers=None, **extra):
    resp = await client.post(
        "/v1/chat/completions",
        headers=headers or {},
        json={"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, **extra},
    )
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_next_conversation_turn_hits_the_prefix_cache(client):
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    first = await ask(client, [SYSTEM, {"role": "user", "content": "What does river mean?"}], conversation_id=cid)
    second = await ask(client, [{"role": "user", "content": "And sea?"}], conversation_id=cid)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 16  # all full blocks of the first prompt
    assert cached % 16 == 0
    stored = (await (await client.get(f"/v1/conversations/{cid}")).json())["messages"]
    billed = [m["usage"]["prompt_tokens_details"]["cached_tokens"] for m in stored if m["role"] == "assistant"]
    assert billed == [0, cached]  # as billed, so a reloaded conversation shows it too


async def test_prefix_cache_is_salted_per_organisation(client):
    store = state_of(client).store
    await store.create_org("a", "free")
    await store.create_org("b", "free")
    _, key_a = await store.create_key("a")
    _, key_b = await store.create_key("b")
    msgs = [SYSTEM, {"role": "user", "content": "Hello"}]
    await ask(client, msgs, {"Authorization": f"Bearer {key_a}"})
    again_a = await ask(client, msgs, {"Authorization": f"Bearer {key_a}"})
    other_b = await ask(client, msgs, {"Authorization": f"Bearer {key_b}"})
    assert again_a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_engine_is_empty_after_requests_and_a_disconnect(client):
    body = {
        "model": "tiny",
        "stream": True,
        "max_tokens": 200,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
    resp = await client.post("/v1/chat/completions", json=body)
    await resp.content.readline()
    resp.close()
    await ask(client, [{"role": "user", "content": "hi"}])
    stats = state_of(client).models["tiny"].backend.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total  # cached blocks stay reusable, none owned


async def test_speculation_over_http_gives_the_same_answers_streamed_and_not(aiohttp_client, tmp_path, tiny_model_dir):
    # engine.speculative_tokens: a step may yield several tokens; the answers, streamed or not,
    # and their usage are those of the engine without it.
    from api.app import init
    from tests.api.helpers import native_settings, sse_events

    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "one two three one two three one two three"}],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    answers = {}
    for k in (0, 4):
        app = init(native_settings(tmp_path / f"k{k}", tiny_model_dir, extra=(f"engine.speculative_tokens={k}",)))
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
        unary = await (await client.post("/v1/chat/completions", json=body)).json()
        events, _ = await sse_events(await client.post("/v1/chat/completions", json={**body, "stream": True}))
        streamed = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict) and e["choices"]
        )
        engine = state_of(client).models["tiny"].backend.engine
        answers[k] = (
            unary["choices"][0]["message"]["content"],
            streamed,
            unary["usage"],
            engine.stats().num_draft_tokens,
        )
    assert answers[4][:3] == answers[0][:3]
    assert answers[4][0] == answers[4][1]
    assert answers[0][3] == 0 and answers[4][3] > 0, "the speculating server never drafted"


async def test_a_restarted_server_finds_the_prefix_cache_of_the_last_one(aiohttp_client, tmp_path, tiny_model_dir):
    # engine.prefix_cache_dir ("auto": beside the database): a clean stop writes the cached
    # blocks, the next start reads them back, and the same prompt is warm at once.
    from api.app import init
    from tests.api.helpers import native_settings

    messages = [SYSTEM, {"role": "user", "content": "What does river mean?"}]
    first = await aiohttp_client(init(native_settings(tmp_path, tiny_model_dir)))
    cold = await ask(first, messages)
    await first.close()  # a clean stop
    assert list((tmp_path / "prefix-cache").glob("*.safetensors"))
    second = await aiohttp_client(init(native_settings(tmp_path, tiny_model_dir)))
    warm = await ask(second, messages)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == (cold["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]  # the same K/V, the same answer
    await second.close()
    off = await aiohttp_client(init(native_settings(tmp_path, tiny_model_dir, extra=('engine.prefix_cache_dir=""',))))
    assert (await ask(off, messages))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_kv_cache_smaller_than_the_context_limits_requests_to_what_it_holds(
    aiohttp_client, tmp_path, tiny_model_dir
):
    """A pool that cannot hold the model's whole context: requests that leave max_tokens to the
    server (or cap it, as Anthropic's does) get what fits instead of a 400 kv_cache_too_small,
    and /v1/models says the context really served."""
    from api.app import init
    from tests.api.helpers import native_settings

    extra = ("engine.kv_cache_bytes=150000", "tiers.enterprise.max_tokens=4096", "models.tiny.max_model_len=2048")
    client = await aiohttp_client(init(native_settings(tmp_path, tiny_model_dir, extra=extra)))
    backend = state_of(client).models["tiny"].backend
    holds = backend.engine.max_sequence_tokens
    assert holds < 2048 and backend.max_model_len == holds, holds
    listed = await (await client.get("/v1/models/tiny")).json()
    assert listed["max_model_len"] == holds
    messages = [{"role": "user", "content": "hello there"}]
    resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "ignore_eos": True})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["usage"]["total_tokens"] == holds and body["choices"][0]["finish_reason"] == "length"
    resp = await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 4096, "messages": messages})
    assert resp.status == 200, await resp.text()
    over = {"model": "tiny", "messages": messages, "max_tokens": holds}
    too_many = await client.post("/v1/chat/completions", json=over)
    err = (await too_many.json())["error"]
    assert too_many.status == 400 and err["code"] == "context_length_exceeded" and str(holds) in err["message"]
