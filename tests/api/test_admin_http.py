"""The admin API (api/admin.py): admin keys manage organisations, keys and usage over HTTP, reach
nothing else, and what they change holds from the next request on."""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3

import pytest

from store.keys import MAX_BUDGET_USD
from tests.api.helpers import assert_error, state_of

USER = [{"role": "user", "content": "Hello there, friend."}]


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def chat(client, secret: str | None = None, model: str = "echo"):
    headers = bearer(secret) if secret else {}
    return await client.post("/v1/chat/completions", json={"model": model, "messages": USER}, headers=headers)


async def make_key(client, headers: dict[str, str], **body) -> dict:
    resp = await client.post("/v1/admin/keys", json=body, headers=headers)
    assert resp.status == 201, await resp.text()
    return await resp.json()


@pytest.fixture
async def admin(make_client):
    """(client, admin secret): the admin key belongs to its own organisation."""
    client = await make_client()
    store = state_of(client).store
    await store.create_org("ops", "free")
    _key, secret = await store.create_key("ops", scope="admin")
    return client, secret


async def test_only_admin_keys_reach_the_admin_api_and_they_reach_nothing_else(admin):
    client, admin_secret = admin
    store = state_of(client).store
    await store.create_org("acme", "enterprise")
    _key, user_secret = await store.create_key("acme")

    # No key (even from loopback, where the rest of the API is keyless): 401. An inference key: 403.
    await assert_error(await client.get("/v1/admin/organizations"), 401, code="invalid_api_key")
    err = await assert_error(
        await client.get("/v1/admin/organizations", headers=bearer(user_secret)), 403, code="admin_key_required"
    )
    assert "--scope admin" in err["message"]
    await assert_error(await client.get("/v1/admin/usage", headers=bearer("sk-made-up-" + "x" * 30)), 401)
    assert (await client.get("/v1/admin/organizations", headers=bearer(admin_secret))).status == 200

    # The admin key is not an inference key: a leaked script credential cannot spend tokens, nor
    # can a chat key mint keys.
    await assert_error(await chat(client, admin_secret), 403, code="admin_key_not_allowed")
    await assert_error(await client.get("/v1/models", headers=bearer(admin_secret)), 403, code="admin_key_not_allowed")
    assert (await chat(client, user_secret)).status == 200
    assert (await chat(client)).status == 200  # keyless loopback, as before


async def test_organisations_are_created_listed_read_and_changed_with_clear_errors(admin):
    client, secret = admin
    h = bearer(secret)
    resp = await client.post(
        "/v1/admin/organizations",
        json={"name": "acme", "tier": "free", "budget_usd": 12.5, "limits": {"requests_per_minute": 30}},
        headers=h,
    )
    assert resp.status == 201, await resp.text()
    org = await resp.json()
    assert (org["object"], org["name"], org["tier"], org["budget_usd"], org["limits"]) == (
        "organization",
        "acme",
        "free",
        12.5,
        {"requests_per_minute": 30},
    )
    names = [o["name"] for o in (await (await client.get("/v1/admin/organizations", headers=h)).json())["data"]]
    assert names == ["acme", "local", "ops"]  # local: the keyless loopback organisation
    got = await (await client.get("/v1/admin/organizations/acme", headers=h)).json()
    assert got["id"] == org["id"] and got["month_spend_usd"] == 0.0

    bad = {
        "tier": ({"name": "x", "tier": "gold"}, "tier"),
        "name": ({"name": "has space", "tier": "free"}, "name"),
        "budget": ({"name": "x", "tier": "free", "budget_usd": -1}, "budget_usd"),
        "limit name": ({"name": "x", "tier": "free", "limits": {"max_tokens": 5}}, "limits"),
        "limit value": ({"name": "x", "tier": "free", "limits": {"tokens_per_minute": 1.5}}, "limits"),
        "field": ({"name": "x", "tier": "free", "owner": "me"}, "owner"),
    }
    for body, param in bad.values():
        resp = await client.post("/v1/admin/organizations", json=body, headers=h)
        await assert_error(resp, 400, param=param)
    await assert_error(
        await client.post("/v1/admin/organizations", json={"name": "acme", "tier": "free"}, headers=h),
        409,
        code="organization_exists",
    )
    await assert_error(await client.get("/v1/admin/organizations/nobody", headers=h), 404)

    resp = await client.patch(
        "/v1/admin/organizations/acme",
        json={
            "tier": "enterprise",
            "budget_usd": None,
            "limits": {"requests_per_minute": None, "tokens_per_minute": 9},
        },
        headers=h,
    )
    changed = await resp.json()
    assert (changed["tier"], changed["budget_usd"], changed["limits"]) == ("enterprise", None, {"tokens_per_minute": 9})
    await assert_error(await client.patch("/v1/admin/organizations/acme", json={}, headers=h), 400)
    cleared = await client.patch("/v1/admin/organizations/acme", json={"limits": None}, headers=h)
    assert (await cleared.json())["limits"] == {}
    await assert_error(await client.patch("/v1/admin/organizations/nobody", json={"tier": "free"}, headers=h), 404)


async def test_a_key_made_over_http_works_at_once_is_listed_without_its_secret_and_revoked_at_once(admin):
    client, secret = admin
    h = bearer(secret)
    await client.post("/v1/admin/organizations", json={"name": "acme", "tier": "enterprise"}, headers=h)
    resp = await client.post(
        "/v1/admin/keys", json={"organization": "acme", "name": "laptop", "expires_in_days": 30}, headers=h
    )
    assert resp.status == 201, await resp.text()
    made = await resp.json()
    user_secret = made["value"]
    assert user_secret.startswith("sk-") and made["scope"] == "inference" and made["status"] == "active"
    assert made["expires_at"] > made["created_at"] + 29 * 86400
    assert (await chat(client, user_secret)).status == 200

    listing = await (await client.get("/v1/admin/keys?organization=acme", headers=h)).text()
    assert made["id"] in listing and user_secret not in listing and made["redacted_value"] in listing
    everyone = (await (await client.get("/v1/admin/keys", headers=h)).json())["data"]
    assert {(k["organization"], k["scope"]) for k in everyone} == {("acme", "inference"), ("ops", "admin")}

    for body, param in (
        ({"organization": "nobody"}, "organization"),
        ({"organization": "acme", "scope": "root"}, "scope"),
        ({"organization": "acme", "expires_in_days": 0}, "expires_in_days"),
        ({"organization": "acme", "name": 5}, "name"),
        ({"organization": "acme", "name": "two\nlines"}, "name"),  # would break `keys list`'s rows
        ({"organization": "acme", "name": "x" * 201}, "name"),
    ):
        status = 404 if param == "organization" else 400
        await assert_error(await client.post("/v1/admin/keys", json=body, headers=h), status, param=param)

    # An organisation the CLI made with a name the API would not create still gets keys and listings.
    await state_of(client).store.create_org("Team A", "free")
    assert (await make_key(client, h, organization="Team A"))["organization"] == "Team A"
    assert (await client.get("/v1/admin/keys?organization=Team%20A", headers=h)).status == 200

    resp = await client.delete(f"/v1/admin/keys/{made['id']}", headers=h)
    assert (await resp.json())["status"] == "revoked"
    await assert_error(await chat(client, user_secret), 401, code="invalid_api_key")
    await assert_error(await client.delete(f"/v1/admin/keys/{made['id']}", headers=h), 404)
    await assert_error(await client.delete("/v1/admin/keys/sk-nothing", headers=h), 404)

    # A second admin key, then the first revokes itself by prefix: it stops at once.
    second = await (
        await client.post("/v1/admin/keys", json={"organization": "ops", "scope": "admin"}, headers=h)
    ).json()
    own_prefix = secret[:11]
    assert (await client.delete(f"/v1/admin/keys/{own_prefix}", headers=h)).status == 200
    await assert_error(await client.get("/v1/admin/keys", headers=h), 401)
    assert (await client.get("/v1/admin/keys", headers=bearer(second["value"]))).status == 200


async def test_an_organisations_new_limits_hold_from_its_next_request(admin):
    client, secret = admin
    h = bearer(secret)
    await client.post("/v1/admin/organizations", json={"name": "acme", "tier": "enterprise"}, headers=h)
    user_secret = (await (await client.post("/v1/admin/keys", json={"organization": "acme"}, headers=h)).json())[
        "value"
    ]
    assert (await chat(client, user_secret)).status == 200  # its principal is now cached
    # The minute's first request counts against the new limit of 2: one more, then 429.
    await client.patch("/v1/admin/organizations/acme", json={"limits": {"requests_per_minute": 2}}, headers=h)
    resp = await chat(client, user_secret)
    assert resp.status == 200 and resp.headers["x-ratelimit-limit-requests"] == "2"
    await assert_error(await chat(client, user_secret), 429, code="rate_limit_exceeded")
    # The key's own /v1/usage shows the budget an admin just set, and this month's spend against it.
    await client.patch("/v1/admin/organizations/acme", json={"budget_usd": 7.5}, headers=h)
    budget = (await (await client.get("/v1/usage", headers=bearer(user_secret))).json())["budget"]
    assert budget["budget_usd"] == 7.5 and budget["month_spend_usd"] > 0
    body = {"tier": "free", "limits": {"requests_per_minute": None}}
    assert (await client.patch("/v1/admin/organizations/acme", json=body, headers=h)).status == 200
    await assert_error(await chat(client, user_secret, model="echo"), 404)  # free serves echo2 only


async def test_usage_of_every_organisation_by_org_and_key(admin):
    client, secret = admin
    h = bearer(secret)
    for org in ("acme", "globex"):
        await client.post("/v1/admin/organizations", json={"name": org, "tier": "enterprise"}, headers=h)
    acme = (await (await client.post("/v1/admin/keys", json={"organization": "acme"}, headers=h)).json())["value"]
    globex = await (await client.post("/v1/admin/keys", json={"organization": "globex"}, headers=h)).json()
    for who in (acme, acme, globex["value"]):
        resp = await chat(client, who)
        assert resp.status == 200
        await resp.read()

    async def usage(query: str) -> dict:
        resp = await client.get(f"/v1/admin/usage?{query}", headers=h)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    by_org = await usage("group_by=org")
    assert {r["organization"]: r["num_requests"] for r in by_org["data"]} == {"acme": 2, "globex": 1}
    assert by_org["total"]["num_requests"] == 3 and by_org["total"]["cost_usd"] > 0
    by_key = await usage("group_by=key&organization=globex")
    assert [(r["key_id"], r["num_requests"]) for r in by_key["data"]] == [(globex["id"], 1)]
    everyone_by_key = await usage("group_by=key")
    assert {r["organization"] for r in everyone_by_key["data"]} == {"acme", "globex"}
    assert (await usage("group_by=org&start=0&end=1"))["data"] == []
    await assert_error(await client.get("/v1/admin/usage?group_by=colour", headers=h), 400, param="group_by")
    await assert_error(await client.get("/v1/admin/usage?organization=nobody", headers=h), 404)
    await assert_error(await client.get("/v1/admin/usage?start=soon", headers=h), 400, param="start")


async def test_a_browser_page_of_another_origin_cannot_drive_the_admin_api(admin):
    client, secret = admin
    resp = await client.post(
        "/v1/admin/keys",
        json={"organization": "ops", "scope": "admin"},
        headers={**bearer(secret), "Origin": "https://evil.example"},
    )
    await assert_error(resp, 403, code="origin_not_allowed")


async def test_the_keyless_organisations_name_is_reserved(admin):
    """Keys for an organisation named `local` would read the keyless user's conversations once
    the server serves keyless on loopback."""
    client, secret = admin
    resp = await client.post("/v1/admin/organizations", json={"name": "local", "tier": "free"}, headers=bearer(secret))
    await assert_error(resp, 400, code="reserved_name")


async def test_a_change_to_the_keyless_local_organisation_reaches_the_running_server(admin):
    client, secret = admin
    assert (await chat(client)).status == 200
    resp = await client.patch(
        "/v1/admin/organizations/local", json={"limits": {"requests_per_minute": 5}}, headers=bearer(secret)
    )
    assert resp.status == 200
    resp = await chat(client)
    assert resp.status == 200 and resp.headers["x-ratelimit-limit-requests"] == "5"


async def test_a_budget_over_the_shared_maximum_is_refused_before_anything_is_written(admin):
    # 1e19 and more crashed every later `orgs list` (too many digits for the nano-dollar).
    client, secret = admin
    h = bearer(secret)
    for budget in (1e20, 2_000_000_000_000, MAX_BUDGET_USD * 1.5):
        body = {"name": "huge", "tier": "free", "budget_usd": budget}
        err = await assert_error(await client.post("/v1/admin/organizations", json=body, headers=h), 400)
        assert err["param"] == "budget_usd" and "at most 1,000,000,000,000" in err["message"]
    assert await state_of(client).store.get_org("huge") is None
    await client.post("/v1/admin/organizations", json={"name": "acme", "tier": "free"}, headers=h)
    patch = await client.patch("/v1/admin/organizations/acme", json={"budget_usd": 1e25}, headers=h)
    await assert_error(patch, 400, param="budget_usd")
    ok = await client.patch("/v1/admin/organizations/acme", json={"budget_usd": MAX_BUDGET_USD}, headers=h)
    assert (await ok.json())["budget_usd"] == MAX_BUDGET_USD


def strict_json(text: str) -> object:
    """`text` parsed as JSON is: Infinity and NaN, which Python's json writes and reads, refused."""

    def refuse(word: str) -> object:
        raise ValueError(f"{word} is not JSON")

    return json.loads(text, parse_constant=refuse)


async def test_an_infinite_expiry_or_budget_in_the_database_is_null_in_valid_json(admin):
    """An expires_at or budget_usd of infinity (stored before their limits were checked) came back as
    JSON Infinity, which JSON parsers (JavaScript's, jq, Go's) refuse: null, never and none, as shown
    for a key or an organisation without one."""
    client, secret = admin
    store = state_of(client).store
    await store.create_org("acme", "free")
    key, user_secret = await store.create_key("acme")
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE api_keys SET expires_at = ? WHERE id = ?", (math.inf, key.id))
        conn.execute("UPDATE orgs SET budget_usd = ? WHERE name = 'acme'", (math.inf,))
    h = bearer(secret)
    keys = strict_json(await (await client.get("/v1/admin/keys?organization=acme", headers=h)).text())
    assert [(k["expires_at"], k["status"]) for k in keys["data"]] == [(None, "active")]
    orgs = strict_json(await (await client.get("/v1/admin/organizations", headers=h)).text())
    assert [o["budget_usd"] for o in orgs["data"] if o["name"] == "acme"] == [None]
    org = strict_json(await (await client.get("/v1/admin/organizations/acme", headers=h)).text())
    assert (org["budget_usd"], org["month_spend_usd"]) == (None, 0.0)
    usage = strict_json(await (await client.get("/v1/usage", headers=bearer(user_secret))).text())
    assert usage["budget"]["budget_usd"] is None
    revoked = strict_json(await (await client.delete(f"/v1/admin/keys/{key.id}", headers=h)).text())
    assert (revoked["expires_at"], revoked["status"]) == (None, "revoked")


async def test_a_burst_right_after_the_keyless_organisations_budget_changes_is_held_to_the_new_budget(make_client):
    """The first request after a change re-reads the `local` organisation; requests arriving while
    it read were served on the old one: 40 of a burst passed a budget meant for about 14. They
    now wait for that one read."""
    client = await make_client("tiers.free.budget_fallback=false", "tiers.enterprise.budget_fallback=false")
    store = state_of(client).store
    await store.create_org("ops", "free")
    _key, admin_secret = await store.create_key("ops", scope="admin")
    assert (await chat(client)).status == 200  # the keyless organisation exists and was read
    resp = await client.patch("/v1/admin/organizations/local", json={"budget_usd": 0.0}, headers=bearer(admin_secret))
    assert resp.status == 200
    get_org = store.get_org

    async def slow_get_org(name):  # a read that takes a while (a busy database)
        await asyncio.sleep(0.2)
        return await get_org(name)

    store.get_org = slow_get_org
    burst = await asyncio.gather(*(chat(client) for _ in range(10)))
    assert [r.status for r in burst] == [429] * 10
    assert state_of(client).local_principal.org.budget_usd == 0.0
