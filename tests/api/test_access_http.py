"""Who may call: presented keys must be valid in every mode, the Host and Origin checks that stop
DNS rebinding and cross-site writes, keyless mode only for loopback + an allowed Host, /metrics."""

from __future__ import annotations

import time

import pytest

from api.app import init
from settings import ConfigError
from tests.api.helpers import assert_error, echo_settings, state_of

USER = [{"role": "user", "content": "Hello there, friend."}]


async def chat(client, headers=None):
    return await client.post("/v1/chat/completions", json={"model": "echo", "messages": USER}, headers=headers or {})


@pytest.mark.parametrize("extra", [(), ("server.require_keys=true",)])
async def test_a_presented_unknown_revoked_or_expired_key_is_401_on_loopback_in_every_mode(make_client, extra):
    client = await make_client(*extra)
    store = state_of(client).store
    await store.create_org("acme", "enterprise")
    key, secret = await store.create_key("acme")
    assert (await chat(client, {"Authorization": f"Bearer {secret}"})).status == 200
    assert await store.revoke_key(key.prefix)
    _key, expired = await store.create_key("acme", expires_at=time.time() - 1)
    for bad in (secret, expired, "sk-made-up-" + "x" * 30, "anything", "local"):
        await assert_error(await chat(client, {"Authorization": f"Bearer {bad}"}), 401, code="invalid_api_key")
    await assert_error(
        await client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"}), 401, code="invalid_api_key"
    )


async def test_without_a_key_loopback_is_served_as_the_local_organisation(make_client):
    client = await make_client()
    assert (await chat(client)).status == 200


async def test_a_foreign_host_is_refused_so_dns_rebinding_cannot_drive_the_api(make_client):
    client = await make_client()
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    rebound = {"Host": "attacker.example:8000"}
    await assert_error(await chat(client, rebound), 403, code="host_not_allowed")
    await assert_error(await client.get(f"/v1/conversations/{cid}", headers=rebound), 403, code="host_not_allowed")
    await assert_error(await client.get("/", headers=rebound), 403, code="host_not_allowed")
    assert (await client.get("/health", headers=rebound)).status == 200  # probes may use any Host
    for ok in ("localhost:8000", "127.0.0.1", "[::1]:8000", "[::1]"):
        assert (await chat(client, {"Host": ok})).status == 200, ok
    for mixed in ("127.0.0.1:8000, attacker.example", "localhost:http", "[::1]x", "local host"):
        await assert_error(await chat(client, {"Host": mixed}), 403, code="host_not_allowed")


async def test_allowed_hosts_adds_names_and_star_never_opens_the_keyless_mode(make_client, tmp_path):
    client = await make_client('server.allowed_hosts=["chat.internal"]')
    assert (await chat(client, {"Host": "chat.internal:8000"})).status == 200
    await assert_error(await chat(client, {"Host": "other.example"}), 403, code="host_not_allowed")

    client = await make_client('server.allowed_hosts=["*"]', f'store.path="{tmp_path / "star.db"}"')
    await assert_error(await chat(client, {"Host": "other.example"}), 401, code="invalid_api_key")
    store = state_of(client).store
    await store.create_org("acme", "enterprise")
    _key, secret = await store.create_key("acme")
    resp = await chat(client, {"Host": "other.example", "Authorization": f"Bearer {secret}"})
    assert resp.status == 200


async def test_a_cross_origin_write_is_refused_and_same_origin_passes(make_client):
    client = await make_client('server.cors_origins=["https://trusted.example"]')
    host = f"127.0.0.1:{client.port}"
    await assert_error(await chat(client, {"Origin": "https://evil.example"}), 403, code="origin_not_allowed")
    await assert_error(await chat(client, {"Origin": "null"}), 403, code="origin_not_allowed")
    await assert_error(
        await client.post("/v1/conversations", json={}, headers={"Origin": "http://evil.example"}),
        403,
        code="origin_not_allowed",
    )
    assert (await chat(client, {"Origin": f"http://{host}"})).status == 200
    assert (await chat(client, {"Origin": "https://trusted.example"})).status == 200
    assert (await client.get("/v1/models", headers={"Origin": "https://evil.example"})).status == 200


def test_keyless_mode_refuses_to_start_behind_a_trusted_proxy(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="require_keys"):
        init(echo_settings(tmp_path, tiny_model_dir, ('server.trusted_proxies=["127.0.0.1"]',)))
    init(echo_settings(tmp_path, tiny_model_dir, ('server.trusted_proxies=["127.0.0.1"]', "server.require_keys=true")))


async def test_metrics_needs_a_key_or_the_metrics_token_when_not_loopback_only(make_client, tmp_path):
    client = await make_client()
    assert (await client.get("/metrics")).status == 200  # loopback-only: open to this machine

    client = await make_client(
        'server.host="0.0.0.0"', 'server.metrics_token="m-token-123"', f'store.path="{tmp_path / "public.db"}"'
    )
    await assert_error(await client.get("/metrics"), 401, code="invalid_api_key")
    await assert_error(await client.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
    assert (await client.get("/metrics", headers={"Authorization": "Bearer m-token-123"})).status == 200
    store = state_of(client).store
    await store.create_org("ops", "free")
    _key, secret = await store.create_key("ops")
    assert (await client.get("/metrics", headers={"Authorization": f"Bearer {secret}"})).status == 200


@pytest.mark.parametrize("param", ["start", "end"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "NaN", "soon"])
async def test_usage_time_bounds_must_be_finite_numbers(make_client, param, value):
    client = await make_client()
    await assert_error(await client.get(f"/v1/usage?{param}={value}"), 400, param=param)
    assert (await client.get(f"/v1/usage?{param}=1700000000.5")).status == 200
