"""Admission as one policy object: cheap refusals first, routing, placement, one release path."""

from __future__ import annotations

import pytest

from gateway.admission import Admission, Caller, estimate_tokens
from gateway.errors import Overloaded, RateLimited, Reason
from gateway.queue import ModelQueue, TicketState
from gateway.ratelimit import RateLimiter
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


def make_admission(capacity: int = 1, **queue_config) -> tuple[Admission, FakeClock]:
    clock = FakeClock()
    config = QueueConfig(**{"max_waiting_requests": 4, "max_wait_s": 120.0, **queue_config})
    queues = {"mini": ModelQueue("mini", config, lambda: True, clock, capacity=capacity)}
    router = TierRouter({"mini": ModelConfig()}, TIERS, queues)
    return Admission(RateLimiter(clock), router, queues), clock


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


async def test_the_prompt_estimate_from_bytes_is_at_least_one_token():
    assert estimate_tokens(0) == 1 and estimate_tokens(4000) == 1000


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
