"""Admission as one policy object: cheap refusals first, routing, placement, one release path."""

from __future__ import annotations

import pytest

from gateway.admission import Admission, Caller, Pass, estimate_tokens
from gateway.errors import Overloaded, RateLimited, Reason
from gateway.queue import ModelQueue, TicketState
from gateway.ratelimit import RateLimiter
from gateway.retry_age import RetryAges
from gateway.router import TierRouter
from settings import ModelConfig, QueueConfig, TierConfig
from tests.gateway.fakes import FakeClock

pytestmark = pytest.mark.asyncio

TIERS = {
    "free": TierConfig(
        priority=0, models=["mini"], wait_target_s=20.0, requests_per_minute=2, max_concurrent_streams=1
    ),
    "enterprise": TierConfig(priority=2, models=["mini"], wait_target_s=5.0, max_concurrent_streams=2),
}


def make_admission(
    capacity: int = 1, *, tiers: dict[str, TierConfig] = TIERS, retry_ages: bool = True, **queue_config
) -> tuple[Admission, FakeClock]:
    clock = FakeClock()
    config = QueueConfig(**{"max_waiting_requests": 4, "max_wait_s": 120.0, **queue_config})
    queues = {"mini": ModelQueue("mini", config, lambda: True, clock, capacity=capacity)}
    router = TierRouter({"mini": ModelConfig()}, tiers, queues)
    ages = RetryAges(config.aging_s, clock) if retry_ages else None
    return Admission(RateLimiter(clock), router, queues, retry_ages=ages), clock


def caller(tier_name: str, key: str = "k1", *, local: bool = False) -> Caller:
    return Caller(key, tier_name, TIERS[tier_name], waits_for_stream=local)


def admit(admission: Admission, who: Caller, request_id: str, num_tokens: int = 20):
    grant = admission.check(who, request_id, 40)
    admission.route(grant, None)
    admission.place(grant, num_tokens)
    return grant


async def test_the_cheap_check_refuses_over_limit_callers_and_takes_nothing():
    admission, _ = make_admission(capacity=8)
    free = caller("free")
    for i in range(2):
        admission.check(free, f"r{i}", 40).close()
    with pytest.raises(RateLimited) as info:
        admission.check(free, "r2", 40)
    assert info.value.reason is Reason.KEY_REQUESTS
    assert admission.limiter.num_streams("k1") == 0


async def test_a_keyed_caller_over_its_stream_cap_is_refused_but_local_use_waits_for_a_stream():
    admission, _ = make_admission(capacity=8)
    held = admission.check(caller("free"), "a", 40)
    with pytest.raises(RateLimited) as info:
        admission.check(caller("free"), "b", 40)
    assert info.value.reason is Reason.CONCURRENT_STREAMS
    held.close()
    local = caller("enterprise", "org:local", local=True)
    grants = [admit(admission, local, f"l{i}") for i in range(3)]  # stream cap 2, capacity 8
    assert [g.ticket.state for g in grants] == [TicketState.ADMITTED, TicketState.ADMITTED, TicketState.WAITING]
    grants[0].close()
    assert grants[2].is_admitted


async def test_a_pass_releases_its_ticket_stream_and_tokens_exactly_once():
    admission, _ = make_admission(capacity=1)
    grant = admit(admission, caller("enterprise"), "r1", num_tokens=300)
    assert grant.is_admitted and admission.queues["mini"].num_reserved == 1
    grant.num_tokens_used = 120
    grant.close()
    grant.close()
    assert admission.queues["mini"].num_reserved == 0 and admission.limiter.num_streams("k1") == 0
    tokens = {v.unit: v.remaining for v in admission.limiter.buckets("k1", "enterprise", TIERS["enterprise"])}
    assert tokens["tokens"] == pytest.approx(100_000 - 120)


async def test_a_refusal_inside_the_pass_refunds_the_request_too():
    admission, _ = make_admission(capacity=1, max_waiting_requests=1)
    admit(admission, caller("enterprise", "e1"), "run")
    admit(admission, caller("enterprise", "e2"), "wait")
    with pytest.raises(Overloaded), admission.check(caller("free", "f1"), "late", 40) as grant:
        admission.route(grant, None)  # the router sees a queue full of a higher tier
    views = {v.unit: v for v in admission.limiter.buckets("f1", "free", TIERS["free"])}
    assert views["requests"].remaining == pytest.approx(2)


async def test_the_cheap_check_refuses_load_before_routing_and_keeps_nothing():
    admission, _ = make_admission(capacity=1, max_waiting_requests=1)
    admit(admission, caller("enterprise", "e1"), "run")
    admit(admission, caller("enterprise", "e2"), "wait")
    with pytest.raises(Overloaded) as info:
        admission.check(caller("free", "f1"), "late", 40)  # no body read, no route, no place
    assert info.value.reason is Reason.QUEUE_FULL
    views = {v.unit: v for v in admission.limiter.buckets("f1", "free", TIERS["free"])}
    assert views["requests"].remaining == pytest.approx(2)
    assert admission.limiter.num_streams("f1") == 0


async def test_a_lower_tier_is_shed_past_its_wait_target_and_the_top_tier_is_queued():
    admission, clock = make_admission(capacity=1, max_waiting_requests=8)
    admit(admission, caller("enterprise", "e0"), "run")
    admit(admission, caller("enterprise", "e1"), "w1")
    clock.advance(30.0)  # nothing admitted for 30 s
    with pytest.raises(Overloaded) as info:
        admit(admission, caller("free", "f1"), "f")
    assert info.value.reason is Reason.WAIT_TOO_LONG
    grant = admit(admission, caller("enterprise", "e2"), "e")  # 60 s estimated: past 5 s, still queued
    assert grant.ticket.state is TicketState.WAITING


async def test_the_enterprise_burst_displaces_free_and_never_exceeds_capacity():
    admission, _ = make_admission(capacity=2, max_waiting_requests=4)
    free = [admit(admission, caller("free", f"f{i}"), f"f{i}") for i in range(2)]
    free += [admit(admission, caller("free", f"g{i}"), f"g{i}") for i in range(2)]  # 2 run, 2 wait
    enterprise = [admit(admission, caller("enterprise", f"e{i}"), f"e{i}") for i in range(4)]
    queue = admission.queues["mini"]
    assert queue.num_reserved == 2 and queue.num_waiting == 4
    displaced = [g for g in free if g.ticket.state is TicketState.RELEASED]
    assert len(displaced) == 2  # both waiting free requests gave their places to enterprise ones
    assert all(g.ticket.state is TicketState.WAITING for g in enterprise)


async def test_the_prompt_estimate_from_bytes_is_at_least_one_token_and_at_most_the_context():
    assert estimate_tokens(0, 4096) == 1 and estimate_tokens(4000, 4096) == 1000
    assert estimate_tokens(6_000_000, 4096) == 4096  # an inline photo is not two million tokens


async def test_the_gateway_knows_nothing_of_http():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "gateway"
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if any(
            line.startswith(("from api", "import api", "from aiohttp", "import aiohttp"))
            for line in path.read_text(encoding="utf-8").splitlines()
        )
    ]
    assert offenders == []


async def test_a_key_refused_for_load_retries_with_its_first_refusal_until_it_is_admitted():
    admission, clock = make_admission(capacity=1, tiers=FLOOD_TIERS, max_waiting_requests=1)
    enterprise = Caller("e", "enterprise", FLOOD_TIERS["enterprise"])
    held = [admit(admission, enterprise, "run"), admit(admission, enterprise, "wait")]
    free = Caller("f1", "free", FLOOD_TIERS["free"])
    first_s = clock()
    for i in range(3):
        with pytest.raises(Overloaded):
            admission.check(free, f"f{i}", 40)
        clock.advance(5.0)
    assert admission.retry_ages.waiting_since("f1") == first_s
    for grant in held:
        grant.close()
    grant = admit(admission, free, "served")
    assert grant.waiting_since_s == first_s and grant.is_admitted
    assert admission.retry_ages.waiting_since("f1") is None  # admitted: its next request arrives fresh


async def test_a_rate_limited_refusal_does_not_age():
    admission, _ = make_admission(capacity=8)
    for i in range(2):
        admission.check(caller("free"), f"r{i}", 40).close()
    with pytest.raises(RateLimited):
        admission.check(caller("free"), "r2", 40)
    assert admission.retry_ages.waiting_since("k1") is None


async def test_a_displaced_request_ages_on_from_when_it_joined_the_line():
    admission, clock = make_admission(capacity=1, max_waiting_requests=1)
    admit(admission, caller("enterprise", "e1"), "run")
    joined_s = clock()
    free = admit(admission, caller("free", "f1"), "f")
    clock.advance(4.0)
    admit(admission, caller("enterprise", "e2"), "e")
    with pytest.raises(Overloaded) as info:
        await free.wait(0)
    assert info.value.reason is Reason.DISPLACED
    assert admission.retry_ages.waiting_since("f1") == joined_s


async def test_a_request_failed_by_shutdown_is_neither_displaced_nor_aged():
    admission, _ = make_admission(capacity=1, max_waiting_requests=1)
    admit(admission, caller("enterprise", "e1"), "run")
    waiting = admit(admission, caller("free", "f1"), "f")
    await admission.queues["mini"].stop()
    with pytest.raises(Overloaded) as info:
        await waiting.wait(0)
    assert info.value.reason is Reason.SHUTTING_DOWN
    assert admission.retry_ages.waiting_since("f1") is None


FLOOD_TIERS = {
    "free": TierConfig(priority=0, models=["mini"], wait_target_s=20.0, requests_per_minute=100_000),
    "plus": TierConfig(priority=1, models=["mini"], wait_target_s=10.0, requests_per_minute=100_000),
    "enterprise": TierConfig(priority=2, models=["mini"], wait_target_s=5.0, requests_per_minute=100_000),
}
SERVICE_S = 1.0  # each admitted request runs this long
STEP_S = 0.25  # clients retry a refusal this much later


async def flood(admission: Admission, clock: FakeClock, horizon_s: float = 120.0) -> dict[str, list[float]]:
    """Issue #15's retry storm in miniature: 8 enterprise clients (4x what a capacity of 2 at
    1 s per request serves), one plus and one free client, each on its own key, asking again
    at once after an answer and STEP_S after a refusal. Returns per client key the seconds
    from its first ask to each admission; checks the engine bound and the refusals on the way."""
    callers = [Caller(f"e{i}", "enterprise", FLOOD_TIERS["enterprise"]) for i in range(8)]
    callers += [Caller("p", "plus", FLOOD_TIERS["plus"]), Caller("f", "free", FLOOD_TIERS["free"])]
    asking_since = {who.key: clock() for who in callers}
    waits: dict[str, list[float]] = {who.key: [] for who in callers}
    held: dict[str, tuple[Pass, float | None]] = {}  # key -> (grant, end of service; None: waiting)
    room = admission.queues["mini"].room
    for step in range(int(horizon_s / STEP_S)):
        clock.advance(STEP_S)
        for key, (grant, end_s) in list(held.items()):
            if end_s is not None and clock() >= end_s:
                grant.close()
                del held[key]
                asking_since[key] = clock()
        for key, (grant, end_s) in list(held.items()):
            if end_s is None:
                try:
                    if await grant.wait(0):
                        held[key] = (grant, clock() + SERVICE_S)
                        waits[key].append(clock() - asking_since[key])
                except Overloaded:
                    grant.close(refund=True)
                    del held[key]
        for who in callers:
            if who.key in held:
                continue
            since_s = admission.retry_ages.waiting_since(who.key)
            try:
                grant = admission.check(who, f"{who.key}-{step}", 40)  # the cheap refusal first, as served
            except Overloaded:
                _check_refusal(room, who, since_s, clock())
                continue
            try:
                admission.route(grant, None)
                admission.place(grant, 20)
            except Overloaded:
                grant.close(refund=True)
                _check_refusal(room, who, since_s, clock())
                continue
            if grant.is_admitted:
                waits[who.key].append(clock() - asking_since[who.key])
            held[who.key] = (grant, clock() + SERVICE_S if grant.is_admitted else None)
        assert room.num_reserved <= room.capacity
    return waits


def _check_refusal(room, who: Caller, since_s: float | None, now: float) -> None:
    """Nobody waits at a lower effective priority than the refused request (aging_s 10)."""
    level = who.tier.priority + (now - (now if since_s is None else since_s)) / 10.0
    assert all(e.priority + (now - e.arrival_s) / 10.0 >= level - 1e-9 for e in room.waiting())


async def test_a_free_key_retrying_under_a_sustained_enterprise_flood_is_served_in_bounded_time():
    admission, clock = make_admission(capacity=2, tiers=FLOOD_TIERS, max_waiting_requests=4, aging_s=10.0)
    waits = await flood(admission, clock)
    enterprise = [w for key, ws in waits.items() if key.startswith("e") for w in ws]
    # A tier n levels down waits at most n x aging_s (and one retry step) longer than the
    # longest enterprise wait: then its carried age ranks it with the enterprise requests.
    assert waits["p"] and max(waits["p"]) <= max(enterprise) + 1 * 10.0 + STEP_S
    assert waits["f"] and max(waits["f"]) <= max(enterprise) + 2 * 10.0 + STEP_S
    assert max(enterprise) < min(waits["p"]) < min(waits["f"])
    assert len(enterprise) > 10 * (len(waits["p"]) + len(waits["f"]))  # the top tier keeps most of it


async def test_without_retry_ages_the_same_flood_starves_the_lower_tiers():
    admission, clock = make_admission(
        capacity=2, tiers=FLOOD_TIERS, retry_ages=False, max_waiting_requests=4, aging_s=10.0
    )
    waits = await flood(admission, clock)
    assert waits["f"] == [] and waits["p"] == []


@pytest.mark.parametrize("age_retries", [True, False])
async def test_the_server_counts_waits_across_retries_unless_the_setting_turns_it_off(age_retries):
    from gateway.admission import build_admission
    from gateway.metrics import Metrics
    from settings import load_settings
    from testing.fake_backend import FakeBackend

    settings = load_settings(None, ["queue.aging_s=10", f"queue.age_retries={str(age_retries).lower()}"])
    admission = build_admission(settings, {"mini": FakeBackend(words=("a",))}, Metrics())
    admission.retry_ages.refused("k")
    assert (admission.retry_ages.waiting_since("k") is not None) is age_retries
