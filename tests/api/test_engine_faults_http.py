"""A native engine whose steps fail, through HTTP: what the callers in flight get, and what the
server says once the engine is dead for good (new requests, /ready and /health)."""

from __future__ import annotations

from tests.api.helpers import assert_error, sse_events, state_of

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_an_engine_dead_after_failed_steps_fails_health_so_a_supervisor_restarts_the_server(native_client):
    """Three failed steps in a row (a device error each time) kill the engine for good: the
    requests in flight got an error, new ones get a 503, and /health answers 503 too, so a
    liveness probe restarts the process instead of leaving it answering 503 forever."""
    client = native_client
    backend = state_of(client).models["tiny"].backend

    def fail(_batch):
        raise RuntimeError("CUDA error: out of memory")

    backend.engine.runner.execute = fail
    events, _ = await sse_events(await client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert events[-1] != "[DONE]" and events[-1]["error"]["code"] == "engine_error"  # type: ignore[index]
    assert (await client.get("/health")).status == 200  # one failed step is not death: the engine serves on
    for _ in range(2):
        await assert_error(await client.post("/v1/chat/completions", json=CHAT), 500, code="engine_error")
    stats = backend.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks_total
    await assert_error(await client.post("/v1/chat/completions", json=CHAT), 503, code="model_unavailable")
    assert (await client.get("/ready")).status == 503
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "engine_dead"
