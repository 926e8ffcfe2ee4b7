"""Who may call: presented keys must be valid in every mode (and are refused before a body is read),
the Host and Origin checks that stop DNS rebinding and cross-site writes, keyless mode only for
loopback + an allowed Host, /metrics."""

from __future__ import annotations

import asyncio
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
    for bad in (secret, expired, "sk-made-up-" + "x" * 30, secret[:-5]):  # shaped like a key: typos and cuts too
        await assert_error(await chat(client, {"Authorization": f"Bearer {bad}"}), 401, code="invalid_api_key")
    await assert_error(
        await client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"}), 401, code="invalid_api_key"
    )


# Chat reads its body itself (after admission); the body-deadline middleware reads the other's.
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/conversations"])
async def test_an_unknown_key_is_refused_before_its_declared_body_arrives(make_client, path):
    """A stranger with a made-up key that declares a body and never sends it gets its 401 at once,
    not after holding the connection for the body deadline (which a keyed caller may use)."""
    client = await make_client("server.body_timeout_s=60")
    host, port = client.server.host, client.server.port
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer sk-{'x' * 40}\r\n"
        "Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n"
    )
    writer.write(head.encode())
    try:
        status_line = await asyncio.wait_for(reader.readline(), 20)  # a third of the body deadline
    finally:
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 401 "), status_line


@pytest.mark.parametrize("placeholder", ["EMPTY", "sk-no-key-required", "ollama", "lm-studio", "local", "sk-xxx"])
async def test_a_placeholder_key_is_no_key_so_loopback_serves_it_as_local_unless_keys_are_required(
    make_client, placeholder
):
    """The openai SDK must send some key; tutorials for other local servers send these."""
    headers = {"Authorization": f"Bearer {placeholder}"}
    keyless = await make_client()
    answered = await chat(keyless, headers)
    assert answered.status == 200
    assert (await keyless.get("/v1/models", headers={"x-api-key": placeholder})).status == 200  # Anthropic's header
    required = await make_client("server.require_keys=true")
    await assert_error(await chat(required, headers), 401, code="invalid_api_key")


async def test_an_unknown_keys_401_says_to_create_keys_with_the_servers_own_database(make_client):
    # A key written to another database (`keys create` without the server's --db) is unknown here.
    client = await make_client()
    err = await assert_error(
        await chat(client, {"Authorization": "Bearer sk-" + "x" * 40}), 401, code="invalid_api_key"
    )
    assert "server.py keys create --org NAME --tier free, giving it the --db or --config this server" in err["message"]


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


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


async def test_a_listed_origin_passes_the_cors_preflight_and_reads_answers_errors_and_streams(make_client):
    """Browser front ends (Open WebUI's direct connections, NextChat...) on another origin: the
    preflight was a 405, and no answer carried Access-Control-Allow-Origin, so none could be read."""
    client = await make_client('server.cors_origins=["http://localhost:3000"]')
    page = {"Origin": "http://localhost:3000"}
    resp = await client.options("/v1/chat/completions", headers={**page, **PREFLIGHT})
    assert resp.status == 204, await resp.text()
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    assert resp.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "echo", "messages": USER, "stream": True},
        headers=page,  # keyless on loopback: the operator listed this page by name
    )
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "x-ratelimit-remaining-requests" in resp.headers["Access-Control-Expose-Headers"]
    assert "Origin" in resp.headers["Vary"] and "[DONE]" in await resp.text()
    resp = await client.post("/v1/chat/completions", json={"model": "nope", "messages": USER}, headers=page)
    assert resp.status == 404 and resp.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"

    evil = {"Origin": "https://evil.example"}
    await assert_error(await client.options("/v1/chat/completions", headers={**evil, **PREFLIGHT}), 403)
    resp = await client.get("/v1/models", headers=evil)
    assert "Access-Control-Allow-Origin" not in resp.headers  # served, but its page cannot read it


async def test_any_origin_gets_cors_but_never_the_keyless_mode(make_client):
    """`"*"`: any site's page may call with a key; a page the user merely visits must not be
    served as the keyless local organisation."""
    client = await make_client('server.cors_origins=["*"]')
    site = {"Origin": "https://any.example"}
    assert (await client.options("/v1/models", headers={**site, **PREFLIGHT})).status == 204
    await assert_error(await client.get("/v1/models", headers=site), 401, code="invalid_api_key")
    await assert_error(await chat(client, site), 401, code="invalid_api_key")
    store = state_of(client).store
    await store.create_org("acme", "enterprise")
    _key, secret = await store.create_key("acme")
    resp = await chat(client, {**site, "Authorization": f"Bearer {secret}"})
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "https://any.example"
    assert (await chat(client)).status == 200  # curl and the own UI stay keyless


async def test_an_http_1_0_stream_ends_by_closing_the_connection(make_client):
    """HTTP/1.0 has no chunked encoding: a stream that said keep-alive ended only at the idle
    timeout (75 s)."""
    import asyncio

    client = await make_client()
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    body = b'{"model": "echo", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), timeout=10)  # read() returns once the server closes
    writer.close()
    assert raw.startswith(b"HTTP/1.0 200") and b"data: [DONE]" in raw
    assert b"keep-alive" not in raw.lower()


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
    _key, admin_secret = await store.create_key("ops", scope="admin")  # admin keys reach /v1/admin/ only
    resp = await client.get("/metrics", headers={"Authorization": f"Bearer {admin_secret}"})
    await assert_error(resp, 403, code="admin_key_not_allowed")
    assert resp.headers["Server"] == "selfhosted-chat"  # no aiohttp or Python version to a stranger


@pytest.mark.parametrize("param", ["start", "end"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "NaN", "soon"])
async def test_usage_time_bounds_must_be_finite_numbers(make_client, param, value):
    client = await make_client()
    await assert_error(await client.get(f"/v1/usage?{param}={value}"), 400, param=param)
    assert (await client.get(f"/v1/usage?{param}=1700000000.5")).status == 200
