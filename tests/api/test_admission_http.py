"""Admission over HTTP: cheap refusals before parsing, displacement as a 503, keyless local
bursts that wait instead of 429, queue comments with the estimated wait."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from api.app import init
from settings import load_settings
from testing.fake_backend import FakeBehaviour
from tests.api.helpers import assert_error, sse_events, state_of

ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "Hello there."}]
LONG = [{"role": "user", "content": " ".join(["word"] * 40)}]
ONE_SLOW_SLOT = FakeBehaviour(token_delay_s=0.03, max_num_running=1)  # one stream at a time, ~30 ms a token


async def chat(client, body, headers=None):
    return await client.post("/v1/chat/completions", json=body, headers=headers or {})


async def key_for(client, tier: str) -> dict[str, str]:
    store = state_of(client).store
    org = f"org-{tier}-{uuid.uuid4().hex[:8]}"
    await store.create_org(org, tier)
    _key, secret = await store.create_key(org)
    return {"Authorization": f"Bearer {secret}"}


async def test_a_caller_over_its_rate_limit_is_refused_before_its_body_is_parsed(make_client):
    client = await make_client("tiers.enterprise.requests_per_minute=1")
    assert (await chat(client, {"model": "echo", "messages": USER})).status == 200
    resp = await client.post("/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    await assert_error(resp, 429, code="rate_limit_exceeded")  # not 400: nothing was parsed


async def test_under_overload_a_refusal_comes_before_the_body_is_parsed(make_client):
    client = await make_client(
        "queue.max_waiting_requests=1",
        'tiers.free.models=["echo"]',
        'tiers.enterprise.models=["echo"]',
        "server.heartbeat_s=5",
        behaviour=ONE_SLOW_SLOT,
    )
    free = await key_for(client, "free")
    enterprise = await key_for(client, "enterprise")
    held = [asyncio.create_task(chat(client, {"stream": True, "messages": LONG}, enterprise)) for _ in range(2)]
    queue = state_of(client).admission.queues["echo"]
    for _ in range(200):  # one running, one waiting: the queue is full of a higher tier
        if queue.num_reserved == 1 and queue.num_waiting == 1:
            break
        await asyncio.sleep(0.01)
    resp = await client.post(
        "/v1/chat/completions", data=b"{not json", headers={**free, "Content-Type": "application/json"}
    )
    await assert_error(resp, 503, code="queue_full")  # not 400: the body was never read
    assert int(resp.headers["Retry-After"]) >= 1
    for task in held:
        events, _ = await sse_events(await task)
        assert events[-1] == "[DONE]"


async def test_a_keyless_local_burst_over_the_stream_cap_waits_instead_of_429(make_client):
    client = await make_client("tiers.enterprise.max_concurrent_streams=1", behaviour=FakeBehaviour(token_delay_s=0.02))
    responses = await asyncio.gather(*(chat(client, {"model": "echo", "messages": USER}) for _ in range(4)))
    assert [r.status for r in responses] == [200] * 4
    assert state_of(client).admission.queues["echo"].num_reserved == 0


async def test_a_keyed_caller_over_its_stream_cap_still_gets_429(make_client):
    client = await make_client("tiers.enterprise.max_concurrent_streams=1", behaviour=FakeBehaviour(token_delay_s=0.03))
    headers = await key_for(client, "enterprise")
    running = asyncio.create_task(chat(client, {"model": "echo", "stream": True, "messages": LONG}, headers))
    await asyncio.sleep(0.3)
    await assert_error(
        await chat(client, {"model": "echo", "messages": USER}, headers), 429, code="rate_limit_exceeded"
    )
    await (await running).read()


async def test_a_higher_tier_displaces_a_waiting_lower_one_which_gets_503_with_retry_after(make_client):
    client = await make_client(
        "queue.max_waiting_requests=1",
        'tiers.free.models=["echo"]',
        'tiers.enterprise.models=["echo"]',
        "server.heartbeat_s=5",
        behaviour=ONE_SLOW_SLOT,
    )
    free = await key_for(client, "free")
    enterprise = await key_for(client, "enterprise")
    running = asyncio.create_task(chat(client, {"stream": True, "messages": LONG}, enterprise))
    await asyncio.sleep(0.2)
    waiting = asyncio.create_task(chat(client, {"stream": True, "messages": USER}, free))
    await asyncio.sleep(0.2)
    newcomer = asyncio.create_task(chat(client, {"stream": True, "messages": USER}, enterprise))
    displaced = await waiting
    await assert_error(displaced, 503, code="queue_displaced")
    assert int(displaced.headers["Retry-After"]) >= 1
    for task in (running, newcomer):
        events, _ = await sse_events(await task)
        assert events[-1] == "[DONE]"


async def test_waiting_streams_see_their_position_and_estimated_wait(make_client):
    client = await make_client('tiers.enterprise.models=["echo"]', behaviour=ONE_SLOW_SLOT)
    running = asyncio.create_task(chat(client, {"stream": True, "messages": LONG}))
    await asyncio.sleep(0.2)
    _, comments = await sse_events(await chat(client, {"stream": True, "messages": USER}))
    queued = [c for c in comments if c.startswith("queued ")]
    assert queued and all(c.split()[1] == "position=1" and c.split()[2].startswith("wait_s=") for c in queued)
    await (await running).read()


async def test_32_concurrent_keyless_local_requests_on_the_default_configuration_are_all_served(
    aiohttp_client, tmp_path, tiny_model_dir
):
    """config.toml as shipped (local tier enterprise: 16 streams, 5 s target; 64 sequences), with
    the tiny model in place of the demo models and a small KV pool."""
    settings = load_settings(
        ROOT / "config.toml",
        [
            f'models.demo-flagship.path="{tiny_model_dir}"',
            f'models.demo-mini.path="{tiny_model_dir}"',
            f'store.path="{tmp_path / "chat.db"}"',
            "safety.enabled=false",
            "engine.kv_cache_bytes=16000000",
            'engine.device="cpu"',
        ],
    )
    client = await aiohttp_client(init(settings), server_kwargs={"handler_cancellation": True})
    bodies = [
        {
            "messages": [{"role": "user", "content": f"Question {i}: what is a river?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        for i in range(32)
    ]
    responses = await asyncio.gather(*(chat(client, body) for body in bodies))
    assert [r.status for r in responses] == [200] * 32, [await r.text() for r in responses if r.status != 200][:2]
    state = state_of(client)
    assert all(q.num_reserved == 0 and q.num_waiting == 0 for q in state.admission.queues.values())


@pytest.mark.parametrize(
    "body",
    [
        {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},  # 404
        {"model": "echo2", "messages": [{"role": "user", "content": "word " * 3000}]},  # 400: past the context
        {"model": "echo2", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99},  # 400
    ],
)
async def test_a_refused_request_still_counts_against_the_request_limit(make_client, body):
    """Only the server's own refusals (load) give the request back: refused requests that cost
    the server work (tokenizing a long prompt) could otherwise be sent at any rate."""
    client = await make_client("tiers.free.requests_per_minute=3", "server.max_body_bytes=100000")
    store = state_of(client).store
    await store.create_org("cheap", "free")
    _key, secret = await store.create_key("cheap")
    headers = {"Authorization": f"Bearer {secret}"}
    statuses = [(await client.post("/v1/chat/completions", json=body, headers=headers)).status for _ in range(5)]
    assert statuses[:3] != [429] * 3 and statuses[3:] == [429, 429], statuses


async def test_writes_to_conversations_and_files_count_against_the_request_limit(make_client):
    """Conversations (with up to 20 first items each), uploads and feedback had no rate limit:
    one free key filled the disk at 100 MB/s."""
    client = await make_client("tiers.free.requests_per_minute=3")
    store = state_of(client).store
    await store.create_org("cheap", "free")
    _key, secret = await store.create_key("cheap")
    headers = {"Authorization": f"Bearer {secret}"}
    statuses = [(await client.post("/v1/conversations", json={}, headers=headers)).status for _ in range(4)]
    assert statuses == [201, 201, 201, 429]
    resp = await client.get("/v1/conversations", headers=headers)  # reads are not limited here
    assert resp.status == 200


async def test_an_organisations_conversations_are_held_to_its_tiers_storage_cap(make_client):
    """Rate limits slow a key down; without a cap it still filled the disk in time."""
    client = await make_client("tiers.free.conversation_storage_bytes=1000")
    store = state_of(client).store
    await store.create_org("cheap", "free")
    _key, secret = await store.create_key("cheap")
    headers = {"Authorization": f"Bearer {secret}"}
    items = [{"role": "user", "content": "x" * 600}]
    first = await client.post("/v1/conversations", json={"items": items}, headers=headers)
    assert first.status == 201
    full = await client.post("/v1/conversations", json={"items": items}, headers=headers)
    await assert_error(full, 400, code="conversation_quota_exceeded")
    cid = (await first.json())["id"]
    chat = {"model": "echo2", "messages": [{"role": "user", "content": "y" * 500}], "conversation_id": cid}
    await assert_error(await client.post("/v1/chat/completions", json=chat, headers=headers), 400)
    assert (await client.delete(f"/v1/conversations/{cid}", headers=headers)).status == 200
    again = await client.post("/v1/conversations", json={"items": items}, headers=headers)
    assert again.status == 201  # deleting gave the room back


async def test_a_turn_refused_after_the_storage_check_leaves_no_room_taken(make_client):
    """The check counts the turn in the organisation's estimate before it is served; a turn then
    refused (here: a file that does not exist) was still counted until the next read of the store,
    so the next turn that fits was refused as over the cap."""
    client = await make_client("tiers.free.conversation_storage_bytes=1000")
    store = state_of(client).store
    await store.create_org("cheap", "free")
    _key, secret = await store.create_key("cheap")
    headers = {"Authorization": f"Bearer {secret}"}
    first = await client.post(
        "/v1/conversations", json={"items": [{"role": "user", "content": "x" * 500}]}, headers=headers
    )
    cid = (await first.json())["id"]
    missing = {"type": "file", "file": {"file_id": "file-0123456789abcdef01234567"}}
    refused = [{"role": "user", "content": [{"type": "text", "text": "y" * 300}, missing]}]
    body = {"model": "echo2", "messages": refused, "conversation_id": cid}
    assert (await client.post("/v1/chat/completions", json=body, headers=headers)).status == 404
    fits = {"model": "echo2", "messages": [{"role": "user", "content": "z" * 300}], "conversation_id": cid}
    resp = await client.post("/v1/chat/completions", json=fits, headers=headers)
    assert resp.status == 200, await resp.text()  # 500 + 300 of 1000 (and the answer)
