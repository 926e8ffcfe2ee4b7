"""Aging that survives a refusal, as pure state on an injected clock: the arrival a key's
retries carry, cleared on admission, expiring, bounded."""

from __future__ import annotations

from gateway.errors import MAX_RETRY_AFTER_S
from gateway.retry_age import RetryAges, expire_s
from tests.gateway.fakes import FakeClock

AGING_S = 10.0


def make_ages(max_keys: int = 100) -> tuple[RetryAges, FakeClock]:
    clock = FakeClock()
    return RetryAges(AGING_S, clock, max_keys=max_keys), clock


def test_a_key_never_refused_arrives_now():
    ages, _ = make_ages()
    assert ages.waiting_since("k") is None and len(ages) == 0


def test_retries_carry_the_first_refusal_of_the_key():
    ages, clock = make_ages()
    first_s = clock()
    ages.refused("k")
    for _ in range(10):  # a client retrying every 2.5 s for 25 s
        clock.advance(2.5)
        assert ages.waiting_since("k") == first_s
        ages.refused("k")
    assert ages.waiting_since("other") is None


def test_an_admission_ends_the_record_and_the_next_refusal_starts_a_new_one():
    ages, clock = make_ages()
    ages.refused("k")
    clock.advance(30.0)
    ages.admitted("k")
    assert ages.waiting_since("k") is None
    clock.advance(1.0)
    ages.refused("k")
    assert ages.waiting_since("k") == clock()


def test_a_displaced_request_ages_from_when_it_joined_the_line():
    ages, clock = make_ages()
    joined_s = clock()
    clock.advance(7.0)
    ages.refused("k", since_s=joined_s)
    assert ages.waiting_since("k") == joined_s
    ages.refused("k", since_s=clock())  # a later start never moves a live record forwards
    assert ages.waiting_since("k") == joined_s


def test_a_record_outlives_the_longest_retry_after_and_expires_when_its_key_stops_retrying():
    ages, clock = make_ages()
    assert expire_s(AGING_S) > MAX_RETRY_AFTER_S  # a client that obeys Retry-After keeps its age
    ages.refused("k")
    clock.advance(expire_s(AGING_S))  # exactly the limit: still alive
    assert ages.waiting_since("k") is not None
    ages.refused("k")  # a retry refreshes it
    clock.advance(expire_s(AGING_S) + 0.1)
    assert ages.waiting_since("k") is None and len(ages) == 0
    ages.refused("k")
    assert ages.waiting_since("k") == clock()  # a fresh record, not the expired start


def test_the_map_is_bounded_and_forgets_the_least_recently_refused_key():
    ages, clock = make_ages(max_keys=3)
    for key in ("a", "b", "c"):
        ages.refused(key)
        clock.advance(1.0)
    ages.refused("a")  # a is now the most recent
    ages.refused("d")
    assert len(ages) == 3
    assert ages.waiting_since("b") is None
    assert [ages.waiting_since(k) is not None for k in ("a", "c", "d")] == [True, True, True]
    for i in range(1000):
        ages.refused(f"flood{i}")
    assert len(ages) == 3


def test_without_aging_nothing_is_remembered():
    clock = FakeClock()
    ages = RetryAges(0.0, clock)
    ages.refused("k")
    assert ages.waiting_since("k") is None and len(ages) == 0
