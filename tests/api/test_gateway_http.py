"""The gateway seen over HTTP: 429s with their headers, budgets, 503 from a full queue,
visible fallback, queue-position comments, per-key stream limits."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import init
from settings import ConfigError
from testing.fake_backend import FakeBehaviour
from tests.api.helpers import assert_error, echo_settings, sse_events, state_of

USER = [{"role": "user", "content": "Hello there."}]
LONG = [{"role": "user", "content": " ".join(["word"] * 40)}]
ONE_SLOW_SLOT = FakeBehaviour(token_delay_s=0.03, max_num_running=1)  # one stream at a time, ~30 ms a token


async def chat(client, body, headers=None):
    return await client.post("/v1/chat/completions", json=body, headers=headers or {})


async def metric(client, name: str, **labels: str) -> float:
    """The value of one /metrics sample (0 when it is absent)."""
    text = await (await client.get("/metrics")).text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def until_metric(client, name: str, at_least: float, **labels: str) -> None:
    """Wait (up to 10 s) until a gauge reaches a value: a condition, not a fixed sleep."""
    for _ in range(1000):
        if await metric(client, name, **labels) >= at_least:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{name}{labels} never reached {at_least}")


async def test_rate_limit_gives_429_with_retry_after_and_ratelimit_headers(make_client):
    client = await make_client("tiers.enterprise.requests_per_minute=2")
    first = await chat(client, {"model": "echo", "messages": USER})
    second = await chat(client, {"model": "echo", "messages": USER})
    assert first.status == second.status == 200
    assert int(first.headers["x-ratelimit-remaining-requests"]) > int(second.headers["x-ratelimit-remaining-requests"])
    refused = await chat(client, {"model": "echo", "messages": USER})
    await assert_error(refused, 429, code="rate_limit_exceeded")
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-should-retry" not in refused.headers


async def test_over_budget_is_429_insufficient_quota_that_the_sdk_must_not_retry(make_client):
    client = await make_client("tiers.free.budget_fallback=false")
    store = state_of(client).store
    await store.create_org("broke", "free", budget_usd=0.0)
    _key, secret = await store.create_key("broke")
    resp = await chat(client, {"messages": USER}, headers={"Authorization": f"Bearer {secret}"})
    await assert_error(resp, 429, code="insufficient_quota")
    assert resp.headers["x-should-retry"] == "false"


async def test_over_budget_with_budget_fallback_is_served_by_the_cheaper_model_visibly(make_client):
    client = await make_client("tiers.enterprise.budget_fallback=true")
    store = state_of(client).store
    await store.create_org("thrifty", "enterprise", budget_usd=0.0)
    _key, secret = await store.create_key("thrifty")
    headers = {"Authorization": f"Bearer {secret}"}
    cid = (await (await client.post("/v1/conversations", json={}, headers=headers)).json())["id"]
    resp = await chat(client, {"model": "echo", "messages": USER, "conversation_id": cid}, headers=headers)
    assert resp.status == 200
    assert (await resp.json())["model"] == "echo2" and resp.headers["x-fallback-from"] == "echo"
    assert resp.headers["x-fallback-reason"] == "over_budget"  # not "busy": the web UI says which
    stored = (await (await client.get(f"/v1/conversations/{cid}", headers=headers)).json())["messages"]
    assert [(m["role"], m.get("model"), m.get("fallback_from"), m.get("fallback_reason")) for m in stored] == [
        ("user", None, None, None),
        ("assistant", "echo2", "echo", "over_budget"),  # after a reload too, the answer says it fell back, and why
    ]


async def test_full_queue_is_503_with_retry_after_and_waiters_see_their_position(make_client):
    client = await make_client(
        "queue.max_waiting_requests=1",
        'tiers.enterprise.models=["echo"]',
        "tiers.enterprise.wait_target_s=1000",
        behaviour=ONE_SLOW_SLOT,
    )
    running = asyncio.create_task(chat(client, {"model": "echo", "stream": True, "messages": LONG}))
    await until_metric(client, "chat_requests_running", 1, model="echo")
    waiting = asyncio.create_task(chat(client, {"model": "echo", "stream": True, "messages": USER}))
    await until_metric(client, "chat_requests_waiting", 1, model="echo")
    refused = await chat(client, {"model": "echo", "stream": True, "messages": USER})
    await assert_error(refused, 503)  # the router sees the full queue first
    assert int(refused.headers["Retry-After"]) >= 1
    _, comments = await sse_events(await waiting)
    assert any(c.startswith("queued position=") for c in comments)
    events, _ = await sse_events(await running)
    assert events[-1] == "[DONE]"


async def test_a_saturated_model_falls_back_to_the_next_one_and_says_so(make_client):
    client = await make_client("tiers.enterprise.wait_target_s=0.001", behaviour=ONE_SLOW_SLOT)
    running = asyncio.create_task(chat(client, {"model": "echo", "stream": True, "messages": LONG}))
    await until_metric(client, "chat_requests_running", 1, model="echo")
    waiting = asyncio.create_task(chat(client, {"model": "echo", "stream": True, "messages": USER}))
    await until_metric(client, "chat_requests_waiting", 1, model="echo")  # a backlog: past the 1 ms target
    resp = await chat(client, {"model": "echo", "messages": USER})
    assert resp.status == 200
    assert (await resp.json())["model"] == "echo2" and resp.headers["x-fallback-from"] == "echo"
    assert resp.headers["x-fallback-reason"] == "busy"
    await (await running).read()
    await (await waiting).read()
    unsaturated = await chat(client, {"model": "echo", "messages": USER})
    assert (await unsaturated.json())["model"] == "echo" and "x-fallback-from" not in unsaturated.headers


async def test_concurrent_streams_per_key_are_limited(make_client):
    # With an API key: keyless local use waits for a stream instead (test_admission_http.py).
    client = await make_client("tiers.enterprise.max_concurrent_streams=1", behaviour=FakeBehaviour(token_delay_s=0.03))
    await state_of(client).store.create_org("acme", "enterprise")
    _key, secret = await state_of(client).store.create_key("acme")
    headers = {"Authorization": f"Bearer {secret}"}
    running = asyncio.create_task(chat(client, {"model": "echo", "stream": True, "messages": LONG}, headers))
    await until_metric(client, "chat_requests_running", 1, model="echo")
    await assert_error(
        await chat(client, {"model": "echo", "messages": USER}, headers), 429, code="rate_limit_exceeded"
    )
    await (await running).read()
    assert (await chat(client, {"model": "echo", "messages": USER}, headers)).status == 200


async def test_metrics_expose_requests_tokens_and_rejections(make_client):
    client = await make_client("tiers.enterprise.requests_per_minute=1")
    assert (await chat(client, {"model": "echo", "messages": USER})).status == 200
    await assert_error(await chat(client, {"model": "echo", "messages": USER}), 429, code="rate_limit_exceeded")
    # refused before routing (the cheap check), so the model label is "-"
    assert await metric(client, "chat_rejections_total", reason="key_requests", kind="limit") == 1
    assert await metric(client, "chat_requests_finished_total", model="echo", finish_reason="stop") == 1


async def test_an_unknown_model_name_never_becomes_a_metrics_label_nor_is_echoed_whole(make_client):
    """Each made-up name was a new label kept for the life of the process (memory without bound,
    /metrics in tens of MB) and came back whole in the 404."""
    client = await make_client()
    name = "m-" + "x" * 5000
    resp = await chat(client, {"model": name, "messages": USER})
    body = await assert_error(resp, 404)
    assert len(body["message"]) <= 1000  # cut in ApiError, whatever the path
    metrics = await (await client.get("/metrics")).text()
    assert "x" * 200 not in metrics and 'model="unknown"' in metrics


async def test_requests_sent_at_once_cannot_overspend_the_budget_many_times(make_client):
    """Each checked only past spend: ten sent together all passed a budget the first one used up
    (72x the budget). An answer in flight now holds its most possible cost until it is billed."""
    client = await make_client(
        "tiers.enterprise.budget_fallback=false",
        "tiers.enterprise.max_concurrent_streams=20",
        behaviour=FakeBehaviour(token_delay_s=0.02),
    )
    store = state_of(client).store
    price = state_of(client).models["echo"].config.price_output_per_mtok
    await store.create_org("thrifty", "enterprise", budget_usd=0.000001)  # about one short answer
    _key, secret = await store.create_key("thrifty")
    headers = {"Authorization": f"Bearer {secret}"}
    body = {"model": "echo", "messages": USER, "max_tokens": 20}
    responses = await asyncio.gather(*(chat(client, body, headers=headers) for _ in range(10)))
    statuses = sorted(r.status for r in responses)
    assert statuses.count(200) <= 2 and set(statuses) <= {200, 429}, statuses
    org = await store.get_org("thrifty")
    assert await store.month_spend_usd(org.id) <= 0.000001 + 2 * 20 * price / 1e6 + 1e-9
    assert state_of(client).budget_in_flight_usd == {}  # every hold released once billed


async def test_a_request_whose_preparation_outlasts_the_budget_is_refused_before_it_runs(make_client):
    """Checked at arrival, then held at admission only against answers still in flight: requests
    whose files took seconds to read each got in after the one before was billed (13x the budget)."""
    client = await make_client("tiers.enterprise.budget_fallback=false")
    state = state_of(client)
    await state.store.create_org("slow", "enterprise", budget_usd=0.000001)
    _key, secret = await state.store.create_key("slow")
    headers = {"Authorization": f"Bearer {secret}"}
    body = {"model": "echo", "messages": USER, "max_tokens": 20}
    preparing, billed = asyncio.Event(), asyncio.Event()
    month_spend_usd, calls = state.store.month_spend_usd, []

    async def slow_spend(org_id):  # its 2nd read: at admission, after its files were read (held here)
        calls.append(org_id)
        if len(calls) == 2:
            preparing.set()
            await billed.wait()
        return await month_spend_usd(org_id)

    state.store.month_spend_usd = slow_spend
    slow = asyncio.create_task(chat(client, {**body, "max_tokens": 19}, headers=headers))
    await asyncio.wait_for(preparing.wait(), 10)
    assert (await chat(client, body, headers=headers)).status == 200  # spends the whole budget
    billed.set()
    await assert_error(await slow, 429, code="insufficient_quota")
    assert state.budget_in_flight_usd == {}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "echo", "prompt": "x", "z" * 20_000: 1}),  # an unknown key
        ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "r" * 20_000, "content": "x"}]}),
        ("/v1/chat/completions", {"model": "echo", "messages": USER, "conversation_id": "c" * 20_000}),
    ],
)
async def test_no_error_is_as_large_as_the_value_that_caused_it(make_client, path, body):
    client = await make_client("server.max_body_bytes=100000")
    resp = await client.post(path, json=body)
    assert 400 <= resp.status < 500 and len(await resp.read()) < 2000


@pytest.mark.parametrize(
    "override, message",
    [
        ('tiers.free.models=["echo2", "ecoh"]', "tiers.free.models names undeclared model 'ecoh'"),
        ('models.echo.fallback="ecoh"', "models.echo.fallback names undeclared model 'ecoh'"),
        ('server.local_tier="gold"', "server.local_tier: tier 'gold' is not declared under [tiers]"),
    ],
)
def test_a_tier_or_fallback_naming_nothing_is_refused_before_any_model_is_built(
    tmp_path, tiny_model_dir, override, message
):
    """A typo there was reported only once every model had loaded its weights: now `init`, which
    builds nothing (the models load when the app starts), refuses it."""
    with pytest.raises(ConfigError) as info:
        init(echo_settings(tmp_path, tiny_model_dir, (override,)))
    assert str(info.value).startswith(message)
