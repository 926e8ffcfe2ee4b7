"""The pure admission state of one model: reservations, priorities, aging, displacement,
shedding and per-key stream caps, on an injected clock (no asyncio)."""

from __future__ import annotations

import math
import random

import pytest

from gateway.errors import Reason
from gateway.waiting_room import Offer, Outcome, WaitingRoom
from settings import QueueConfig
from tests.gateway.fakes import FakeClock

FREE, PLUS, ENTERPRISE = 0, 1, 2


def make_room(capacity: int = 2, clock: FakeClock | None = None, **config) -> WaitingRoom:
    cfg = QueueConfig(
        **{"max_waiting_requests": 4, "max_waiting_tokens": 1000, "max_wait_s": 60.0, "aging_s": 10.0, **config}
    )
    return WaitingRoom(cfg, capacity, clock or FakeClock())


def offer(request_id: str, priority: int = FREE, num_tokens: int = 10, **kwargs) -> Offer:
    return Offer(request_id, priority, num_tokens, **kwargs)


def check_invariants(room: WaitingRoom) -> None:
    assert room.capacity == 0 or room.num_reserved <= room.capacity
    assert room.num_waiting <= room.config.max_waiting_requests
    assert room.num_waiting_tokens <= room.config.max_waiting_tokens


def test_a_burst_never_holds_more_reservations_than_capacity():
    room = make_room(capacity=2, max_waiting_requests=8)
    outcomes = [room.place(offer(f"r{i}")).outcome for i in range(12)]
    check_invariants(room)
    assert outcomes[:2] == [Outcome.ADMITTED] * 2
    assert outcomes[2:10] == [Outcome.QUEUED] * 8
    assert outcomes[10:] == [Outcome.REFUSED] * 2
    assert room.admit_ready() == []  # nothing freed: nobody else may start
    assert (room.num_reserved, room.num_waiting) == (2, 8)


def test_each_release_admits_exactly_one_waiter_head_first():
    room = make_room(capacity=2, max_waiting_requests=8)
    for request_id, priority in [("a", FREE), ("b", FREE), ("f", FREE), ("p", PLUS), ("e", ENTERPRISE)]:
        room.place(offer(request_id, priority))
    admitted = []
    for finished in ("a", "b", "e", "p"):
        assert room.release(finished) is True
        admitted += room.admit_ready()
        check_invariants(room)
    assert admitted == ["e", "p", "f"]
    assert room.num_reserved == 1 and room.num_waiting == 0


def test_a_reservation_and_a_place_are_released_exactly_once():
    room = make_room(capacity=1)
    room.place(offer("running"))
    room.place(offer("waiting"))
    assert room.release("waiting") and not room.release("waiting")
    assert room.release("running") and not room.release("running")
    assert (room.num_reserved, room.num_waiting, room.num_waiting_tokens, room.num_cancelled) == (0, 0, 0, 1)


def test_an_aged_free_request_goes_before_a_newer_enterprise_one():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock)
    room.place(offer("running", ENTERPRISE))
    room.place(offer("free", FREE))
    clock.advance(21.0)  # more than 2 levels * aging_s
    room.place(offer("enterprise", ENTERPRISE))
    room.release("running")
    assert room.admit_ready() == ["free"]


def test_a_higher_tier_takes_the_place_of_the_newest_lowest_request_in_a_full_line():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock, max_waiting_requests=3)
    room.place(offer("running", FREE))
    for request_id in ("f1", "f2", "p1"):
        room.place(offer(request_id, FREE if request_id[0] == "f" else PLUS))
        clock.advance(1.0)
    placement = room.place(offer("e1", ENTERPRISE))
    assert (placement.outcome, placement.displaced) == (Outcome.QUEUED, ("f2",))
    placement = room.place(offer("e2", ENTERPRISE))
    assert placement.displaced == ("f1",)
    placement = room.place(offer("p2", PLUS))
    assert placement.outcome is Outcome.REFUSED and placement.reason is Reason.QUEUE_FULL
    assert placement.num_outranked_waiting == 0  # no lower tier held a place
    assert room.num_displaced == 2 and room.num_waiting == 3
    check_invariants(room)


def test_a_same_tier_newcomer_never_displaces_anyone():
    room = make_room(capacity=1, max_waiting_requests=2)
    for request_id in ("run", "e1", "e2"):
        room.place(offer(request_id, ENTERPRISE))
    placement = room.place(offer("e3", ENTERPRISE))
    assert (placement.outcome, placement.reason, placement.displaced) == (Outcome.REFUSED, Reason.QUEUE_FULL, ())
    assert placement.retry_after_s >= 1.0


def test_a_lower_tier_request_that_aged_past_the_newcomer_keeps_its_place():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock, max_waiting_requests=1)
    room.place(offer("running", ENTERPRISE))
    room.place(offer("old-free", FREE))
    clock.advance(25.0)  # effective priority 2.5: ahead of a fresh enterprise request
    placement = room.place(offer("e", ENTERPRISE, wait_limit_s=math.inf))
    assert placement.outcome is Outcome.REFUSED and placement.num_outranked_waiting == 1
    assert room.is_waiting("old-free")


def test_displacement_takes_enough_tokens_or_nobody():
    room = make_room(capacity=1, max_waiting_requests=10, max_waiting_tokens=100)
    room.place(offer("running", FREE))
    room.place(offer("p", PLUS, 50))
    room.place(offer("f1", FREE, 25))
    room.place(offer("f2", FREE, 25))
    too_big = room.place(offer("e-big", ENTERPRISE, 80))  # needs all three places: each is a lower tier
    assert too_big.outcome is Outcome.QUEUED and set(too_big.displaced) == {"f1", "f2", "p"}
    room2 = make_room(capacity=1, max_waiting_requests=10, max_waiting_tokens=100)
    room2.place(offer("running", FREE))
    room2.place(offer("e0", ENTERPRISE, 50))
    room2.place(offer("f", FREE, 50))
    refused = room2.place(offer("p", PLUS, 80))  # f's 50 tokens are not enough; e0 outranks p
    assert refused.outcome is Outcome.REFUSED and room2.is_waiting("f")
    assert room2.place(offer("huge", ENTERPRISE, 101)).reason is Reason.QUEUE_FULL


def test_a_wait_beyond_the_limit_is_shed_and_no_limit_means_queued():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock, max_waiting_requests=10)
    room.place(offer("running", ENTERPRISE))
    room.place(offer("a", FREE))
    clock.advance(15.0)  # nothing admitted for 15 s: at least 15 s per admission
    assert room.estimated_wait_s(FREE) == pytest.approx(30.0)
    shed = room.place(offer("b", FREE, wait_limit_s=20.0))
    assert (shed.outcome, shed.reason) == (Outcome.REFUSED, Reason.WAIT_TOO_LONG)
    assert shed.retry_after_s == pytest.approx(10.0)
    assert room.place(offer("top", ENTERPRISE, wait_limit_s=math.inf)).outcome is Outcome.QUEUED


def test_a_key_at_its_stream_cap_waits_while_other_keys_pass():
    room = make_room(capacity=8, max_waiting_requests=8)
    local = dict(key="local", max_running_per_key=2)
    outcomes = [room.place(offer(f"l{i}", ENTERPRISE, **local)).outcome for i in range(4)]
    assert outcomes == [Outcome.ADMITTED, Outcome.ADMITTED, Outcome.QUEUED, Outcome.QUEUED]
    assert room.place(offer("other", FREE, key="k2")).outcome is Outcome.ADMITTED
    assert room.admit_ready() == []  # capacity is free, but the local key is at its cap
    room.release("l0")
    assert room.admit_ready() == ["l2"]
    room.release("other")
    assert room.admit_ready() == []
    assert room.num_reserved == 2


def test_no_room_in_the_engine_holds_every_admission_back():
    room = make_room(capacity=4)
    assert room.place(offer("a"), engine_has_room=False).outcome is Outcome.QUEUED
    assert room.admit_ready(engine_has_room=False) == []
    assert room.admit_ready(engine_has_room=True) == ["a"]


def test_the_wait_estimate_follows_the_measured_admission_rate():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock)
    room.place(offer("run"))
    for request_id in ("a", "b", "c"):
        room.place(offer(request_id))
    for finished in ("run", "a"):
        clock.advance(2.0)
        room.release(finished)
        room.admit_ready()
    # two admissions 2 s apart; one still waits, so a newcomer is second in line
    assert room.estimated_wait_s(FREE) == pytest.approx(4.0)
    assert room.estimated_wait_of_s("c") == pytest.approx(2.0)


def test_a_low_priority_estimate_counts_higher_priority_arrivals_that_will_cut_in():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock, max_waiting_requests=100)
    room.place(offer("run"))
    room.place(offer("f0", FREE))
    for i in range(5):  # 5 enterprise arrivals at once: about 0.5 per second over the 10 s window
        room.place(offer(f"e{i}", ENTERPRISE))
    clock.advance(1.0)  # nothing admitted for 1 s: 1 s per admission
    assert room.estimated_wait_s(ENTERPRISE) == pytest.approx(6.0)  # 5 ahead, nobody cuts in
    rate = 0.5 * math.exp(-0.1)
    assert room.estimated_wait_s(FREE) == pytest.approx(7.0 / (1.0 - rate))


def test_without_aging_a_flooded_low_tier_has_no_wait_bound():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock, max_waiting_requests=100, aging_s=0.0)
    room.place(offer("run", ENTERPRISE))
    for i in range(30):
        room.place(offer(f"e{i}", ENTERPRISE))
    clock.advance(1.0)
    assert math.isinf(room.estimated_wait_s(FREE))
    shed = room.place(offer("f", FREE, wait_limit_s=60.0))
    assert shed.reason is Reason.WAIT_TOO_LONG


def test_assess_changes_nothing():
    room = make_room(capacity=1, max_waiting_requests=1)
    room.place(offer("run"))
    room.place(offer("f"))
    assert room.assess(offer("e", ENTERPRISE)).displaced == ("f",)
    assert room.is_waiting("f") and room.num_displaced == 0


def test_past_its_wait_limit_a_request_sheds_the_last_lower_tier_request_instead_of_being_refused():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock, max_waiting_requests=10)
    room.place(offer("running", ENTERPRISE))
    room.place(offer("e1", ENTERPRISE))
    room.place(offer("f1", FREE))
    room.place(offer("f2", FREE))
    clock.advance(8.0)  # 8 s per admission: plus would wait over 16 s, past its 15 s limit
    placement = room.place(offer("p", PLUS, wait_limit_s=15.0))
    assert (placement.outcome, placement.displaced) == (Outcome.QUEUED, ("f2",))  # the lowest tier goes first
    assert room.place(offer("p2", PLUS, wait_limit_s=15.0)).displaced == ("f1",)
    shed = room.place(offer("p3", PLUS, wait_limit_s=15.0))  # no lower tier left: now plus is shed
    assert (shed.outcome, shed.reason, shed.num_outranked_waiting) == (Outcome.REFUSED, Reason.WAIT_TOO_LONG, 0)
    free = room.place(offer("f3", FREE, wait_limit_s=15.0))
    assert (free.outcome, free.reason) == (Outcome.REFUSED, Reason.WAIT_TOO_LONG)


def test_n_choices_reserve_n_sequences_and_the_head_waits_for_all_of_them():
    room = make_room(capacity=4, max_waiting_requests=8)
    assert room.place(offer("n3", num_seqs=3)).outcome is Outcome.ADMITTED
    assert room.place(offer("one")).outcome is Outcome.ADMITTED
    assert room.num_reserved == 4
    room.place(offer("n2", PLUS, num_seqs=2))
    room.place(offer("later"))
    room.release("one")
    assert room.admit_ready() == []  # one sequence free: the head needs two, and nobody passes it
    room.release("n3")
    assert room.admit_ready() == ["n2", "later"] and room.num_reserved == 3
    wide = make_room(capacity=2)
    assert wide.place(offer("n5", num_seqs=5)).outcome is Outcome.ADMITTED  # alone, never stuck
    assert wide.place(offer("next")).outcome is Outcome.QUEUED


def test_a_retry_carrying_its_first_refusal_displaces_a_fresh_enterprise_tail():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock, max_waiting_requests=2)
    for request_id in ("running", "e1", "e2"):
        room.place(offer(request_id, ENTERPRISE))
    first_refused_s = clock()
    assert room.place(offer("fresh-free", FREE)).outcome is Outcome.REFUSED
    clock.advance(21.0)  # the free key keeps asking for 21 s, just over 2 levels
    room.release("running")
    assert room.admit_ready() == ["e1"]
    room.place(offer("e3", ENTERPRISE))
    assert room.place(offer("fresh-free-2", FREE)).outcome is Outcome.REFUSED  # without its age: refused
    placement = room.place(offer("retry", FREE, arrival_s=first_refused_s))
    assert (placement.outcome, placement.displaced) == (Outcome.QUEUED, ("e3",))
    assert [e.request_id for e in room.waiting()] == ["e2", "retry"]  # e2 waited 21 s as enterprise
    room.release("e1")
    assert room.admit_ready() == ["e2"]
    room.release("e2")
    assert room.admit_ready() == ["retry"]


def test_an_aged_retry_keeps_its_place_against_a_fresh_enterprise_request():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock, max_waiting_requests=1)
    room.place(offer("running", ENTERPRISE))
    room.place(offer("retry", FREE, arrival_s=clock() - 25.0))  # effective priority 2.5
    placement = room.place(offer("e", ENTERPRISE, wait_limit_s=math.inf))
    assert (placement.outcome, placement.displaced) == (Outcome.REFUSED, ())
    assert (placement.num_outranked_waiting, placement.num_below_waiting) == (1, 0)  # a lower tier, aged past it
    assert room.is_waiting("retry")


def test_a_carried_arrival_in_the_future_counts_as_now():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock)
    room.place(offer("running"))
    room.place(offer("later", FREE, arrival_s=clock() + 100.0))
    assert [e.arrival_s for e in room.waiting()] == [clock()]


def test_an_aged_retry_expects_no_cut_ins_from_the_tiers_it_has_aged_past():
    clock = FakeClock()
    room = make_room(capacity=1, clock=clock, max_waiting_requests=100)
    room.place(offer("run"))
    for i in range(5):  # enterprise keeps arriving: fresh free requests expect it to cut in
        room.place(offer(f"e{i}", ENTERPRISE))
    clock.advance(1.0)
    fresh = room.assess(offer("fresh", FREE)).estimated_wait_s
    aged = room.assess(offer("aged", FREE, arrival_s=clock() - 22.0)).estimated_wait_s
    assert aged == pytest.approx(1.0)  # first in line (ahead of every enterprise request), nobody cuts in
    assert fresh > 6.0


def test_nobody_is_refused_while_a_request_of_lower_effective_priority_holds_a_place():
    """Random offers of every tier, some carrying a retry age, against a small line: every
    refusal is checked against the waiting entries' aged priorities, computed here."""
    rng = random.Random(15)
    clock = FakeClock()
    room = make_room(capacity=2, clock=clock, max_waiting_requests=4)
    num_refused = 0
    for i in range(3000):
        clock.advance(rng.uniform(0.0, 0.5))
        if rng.random() < 0.3:
            for request_id in [r for r in (f"r{j}" for j in range(max(0, i - 40), i)) if room.is_reserved(r)][:1]:
                room.release(request_id)
            room.admit_ready()
        priority = rng.choice((FREE, PLUS, ENTERPRISE))
        arrival_s = clock() - rng.uniform(0.0, 35.0) if rng.random() < 0.5 else None
        placement = room.place(offer(f"r{i}", priority, arrival_s=arrival_s, wait_limit_s=math.inf))
        check_invariants(room)
        if placement.outcome is Outcome.REFUSED:
            num_refused += 1
            level = priority + (clock() - (clock() if arrival_s is None else arrival_s)) / 10.0
            below = [e for e in room.waiting() if e.priority + (clock() - e.arrival_s) / 10.0 < level - 1e-9]
            assert below == [], f"r{i} refused while {below} waited"
    assert num_refused > 100  # the line was full often enough to test something
