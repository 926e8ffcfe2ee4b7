"""Replica choice and health as pure state: breaker transitions, least outstanding requests,
conversation affinity, and what the queue in front is told (has_room, is_available)."""

from __future__ import annotations

from engine.types import ChatPrompt, GenerationRequest, SamplingParams
from engine.upstream.breaker import BreakerState, CircuitBreaker, FailureKind
from engine.upstream.replicas import Replica, ReplicaPool, affinity_key, public_url


def pool(n: int = 2, max_in_flight: int = 2, threshold: int = 3) -> ReplicaPool:
    return ReplicaPool(
        [Replica(i, f"http://r{i}:8000/v1/", CircuitBreaker(threshold, 5.0)) for i in range(n)],
        max_in_flight,
        affinity_entries=100,
    )


def request(*messages: tuple[str, str], salt: str | None = "org-1") -> GenerationRequest:
    chat = ChatPrompt(tuple({"role": r, "content": c} for r, c in messages))
    return GenerationRequest("req", (1, 2, 3), SamplingParams(max_tokens=4), cache_salt=salt, chat=chat)


def test_a_refused_connection_opens_the_breaker_at_once_and_5xx_after_the_threshold():
    breaker = CircuitBreaker(3, open_s=5.0)
    breaker.record_failure(FailureKind.SERVER_ERROR, 0.0)
    breaker.record_failure(FailureKind.TIMEOUT, 0.0)
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure(FailureKind.SERVER_ERROR, 1.0)
    assert breaker.state is BreakerState.OPEN
    other = CircuitBreaker(3, open_s=5.0)
    other.record_failure(FailureKind.CONNECTION, 0.0)
    assert other.state is BreakerState.OPEN


def test_a_success_resets_the_count_of_consecutive_failures():
    breaker = CircuitBreaker(2, open_s=5.0)
    breaker.record_failure(FailureKind.SERVER_ERROR, 0.0)
    breaker.record_success()
    breaker.record_failure(FailureKind.SERVER_ERROR, 0.0)
    assert breaker.state is BreakerState.CLOSED


def test_an_open_breaker_is_probed_after_open_s_then_half_open_until_a_trial_request_ends():
    breaker = CircuitBreaker(1, open_s=5.0)
    breaker.record_failure(FailureKind.CONNECTION, 10.0)
    assert not breaker.probe_due(14.9) and breaker.probe_due(15.0)
    assert breaker.seconds_until_probe(12.0) == 3.0
    breaker.probe_failed(15.0)  # still down: wait another open_s
    assert not breaker.probe_due(19.0) and breaker.probe_due(20.0)
    breaker.probe_succeeded()
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_failure(FailureKind.SERVER_ERROR, 21.0)  # the trial failed: open again at once
    assert breaker.state is BreakerState.OPEN
    breaker.probe_succeeded()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.num_opened == 2


def test_least_outstanding_requests_wins_and_full_replicas_are_skipped():
    p = pool(3, max_in_flight=2)
    p.replicas[0].num_in_flight = 1
    p.replicas[1].num_in_flight = 2  # full
    p.replicas[2].num_in_flight = 0
    assert p.pick(None).index == 2
    p.replicas[2].num_in_flight = 1
    assert p.pick(None).index in (0, 2)
    assert p.pick(None, exclude=frozenset({0, 2})) is None  # only the full one is left


def test_idle_replicas_share_the_first_requests_in_turn():
    p = pool(2)
    assert {p.pick(None).index for _ in range(4)} == {0, 1}


def test_an_open_replica_gets_nothing_and_a_half_open_one_one_trial_at_a_time():
    p = pool(2)
    p.replicas[0].breaker.record_failure(FailureKind.CONNECTION, 0.0)
    assert all(p.pick(None).index == 1 for _ in range(3))
    p.replicas[0].breaker.probe_succeeded()
    p.replicas[1].num_in_flight = 2
    assert p.pick(None).index == 0
    p.replicas[0].num_in_flight = 1
    assert p.pick(None) is None and not p.has_room()


def test_a_conversation_sticks_to_the_replica_of_its_last_turn_while_it_is_healthy_and_has_room():
    p = pool(2, max_in_flight=2)
    turn1 = request(("system", "Be brief."), ("user", "Tell me about rivers."))
    turn2 = request(
        ("system", "Be brief."), ("user", "Tell me about rivers."), ("assistant", "Water."), ("user", "And the sea?")
    )
    key = affinity_key(turn1)
    assert key == affinity_key(turn2)
    p.remember(key, p.replicas[1])
    p.replicas[1].num_in_flight = 1  # busier, but it holds the conversation's prefix cache
    assert p.pick(key).index == 1
    p.replicas[1].num_in_flight = 2  # full: go elsewhere rather than hold the request
    assert p.pick(key).index == 0
    p.replicas[1].num_in_flight = 0
    p.replicas[1].breaker.record_failure(FailureKind.CONNECTION, 0.0)  # unhealthy: go elsewhere
    assert p.pick(key).index == 0


def test_affinity_keys_differ_between_conversations_and_organisations():
    a = request(("user", "Tell me about rivers."))
    assert affinity_key(a) != affinity_key(request(("user", "Tell me about lakes.")))
    assert affinity_key(a) != affinity_key(request(("user", "Tell me about rivers."), salt="org-2"))


def test_the_affinity_table_is_bounded():
    p = ReplicaPool([Replica(0, "http://a/v1", CircuitBreaker(1, 1.0))], 1, affinity_entries=2)
    for key in (b"a", b"b", b"c"):
        p.remember(key, p.replicas[0])
    assert list(p._affinity) == [b"b", b"c"]


def test_with_every_replica_out_the_model_is_unavailable_and_the_queue_may_hand_requests_over():
    p = pool(2)
    for r in p.replicas:
        r.breaker.record_failure(FailureKind.CONNECTION, 0.0)
    assert not p.is_available
    assert p.has_room()  # admitted requests fail fast with a 503 instead of waiting in our queue
    assert p.pick(None) is None


def test_urls_in_logs_and_metrics_carry_no_credentials():
    assert public_url("https://user:secret@gpu-a:8000/v1?key=x") == "https://gpu-a:8000/v1"
    assert Replica(0, "http://gpu-b:8000/v1/", CircuitBreaker(1, 1.0)).base_url == "http://gpu-b:8000/v1"
