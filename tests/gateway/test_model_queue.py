"""The asyncio ModelQueue: admission when there is room, hand-off, estimates, cancellation."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.queue import ModelQueue, QueueClosed, QueueFull, TicketState, WaitTooLong
from settings import QueueConfig
from tests.gateway.fakes import FakeClock

pytestmark = pytest.mark.asyncio
FREE, PLUS, ENTERPRISE = 0, 1, 2


class Slots:
    """A backend's capacity: has_room() while free slots remain; owners take one on admission."""

    def __init__(self, num_free: int = 0):
        self.num_free = num_free

    def has_room(self) -> bool:
        return self.num_free > 0


def make_queue(slots: Slots, clock=None, **config) -> ModelQueue:
    cfg = QueueConfig(**{"max_waiting_requests": 8, "max_waiting_tokens": 1000, "max_wait_s": 60.0,
                         "aging_s": 10.0, **config})
    return ModelQueue("mini", cfg, slots.has_room, clock or FakeClock(), poll_interval_s=0.01)


async def run_owner(ticket, slots: Slots, order: list[str]) -> None:
    """What the request handler does: wait, then occupy a backend slot at once."""
    assert await asyncio.wait_for(ticket.wait(), 5.0)
    slots.num_free -= 1
    order.append(ticket.request_id)


async def test_a_request_with_room_and_nobody_waiting_is_admitted_at_once():
    slots = Slots(1)
    queue = make_queue(slots)
    ticket = queue.enqueue("r1", FREE, 10)
    assert ticket.state is TicketState.ADMITTED
    assert await ticket.wait(0) is True
    assert ticket.queue_time_s == 0.0
    assert queue.num_waiting == 0 and queue.estimated_wait_s() == 0.0


async def test_waiters_are_admitted_by_priority_when_room_frees():
    slots = Slots(0)
    queue = make_queue(slots)
    tickets = [queue.enqueue(rid, prio, 10) for rid, prio in
               [("f1", FREE), ("e1", ENTERPRISE), ("p1", PLUS), ("e2", ENTERPRISE)]]
    assert [t.position for t in tickets] == [4, 1, 3, 2]
    order: list[str] = []
    owners = [asyncio.create_task(run_owner(t, slots, order)) for t in tickets]
    await asyncio.sleep(0.05)
    assert order == []
    slots.num_free = 4
    queue.notify()
    await asyncio.gather(*owners)
    assert order == ["e1", "e2", "p1", "f1"]
    assert queue.num_admitted == 4 and queue.num_waiting == 0
    await queue.stop()


async def test_the_dispatcher_waits_for_each_owner_before_asking_has_room_again():
    slots = Slots(0)
    queue = make_queue(slots)
    tickets = [queue.enqueue(f"r{i}", FREE, 10) for i in range(5)]
    order: list[str] = []
    owners = [asyncio.create_task(run_owner(t, slots, order)) for t in tickets]
    slots.num_free = 2
    queue.notify()
    await asyncio.sleep(0.1)
    # has_room() stayed true until each owner took its slot; without the hand-off all 5 would go
    assert order == ["r0", "r1"]
    assert queue.num_waiting == 3
    await queue.stop()
    results = await asyncio.gather(*owners, return_exceptions=True)
    assert sum(isinstance(r, QueueClosed) for r in results) == 3


async def test_notify_wakes_the_dispatcher_without_waiting_for_a_poll():
    slots = Slots(0)
    cfg = QueueConfig(max_waiting_requests=8, max_waiting_tokens=1000, max_wait_s=60.0, aging_s=10.0)
    queue = ModelQueue("mini", cfg, slots.has_room, FakeClock(), poll_interval_s=3600.0)
    ticket = queue.enqueue("r1", FREE, 10)
    await asyncio.sleep(0.01)
    slots.num_free = 1
    queue.notify()
    assert await asyncio.wait_for(ticket.wait(), 5.0) is True
    await queue.stop()


async def test_a_full_queue_refuses_with_a_503_and_retry_after():
    queue = make_queue(Slots(0), max_waiting_requests=2)
    queue.enqueue("a", FREE, 10)
    queue.enqueue("b", FREE, 10)
    with pytest.raises(QueueFull) as info:
        queue.enqueue("c", ENTERPRISE, 10)
    error = info.value.to_api_error()
    assert (error.status, error.code) == (503, "queue_full")
    assert int(error.headers["Retry-After"]) >= 1
    with pytest.raises(QueueFull):
        make_queue(Slots(0), max_waiting_tokens=50).enqueue("big", FREE, 51)
    assert queue.num_rejected == 1
    await queue.stop()


async def test_an_estimated_wait_beyond_max_wait_is_refused_with_wait_too_long():
    clock = FakeClock()
    queue = make_queue(Slots(0), clock, max_wait_s=40.0)
    queue.enqueue("a", FREE, 10)
    queue.enqueue("b", FREE, 10)
    clock.advance(15.0)  # nothing admitted for 15 s: at least 15 s per admission
    assert queue.estimated_wait_s(FREE) == pytest.approx(45.0)
    assert queue.estimated_wait_s(ENTERPRISE) == pytest.approx(15.0)  # goes ahead of both
    with pytest.raises(WaitTooLong) as info:
        queue.enqueue("c", FREE, 10)
    assert info.value.to_api_error().status == 503
    assert info.value.retry_after_s == pytest.approx(5.0)
    assert queue.enqueue("e", ENTERPRISE, 10).position == 1  # a higher tier still fits
    assert not queue.can_take(FREE, 10, wait_limit_s=30.0)
    assert queue.can_take(ENTERPRISE, 10, wait_limit_s=60.0)
    clock.advance(10.0)  # the free ones have now aged past a fresh enterprise request
    assert queue.estimated_wait_s(ENTERPRISE) == pytest.approx(4 * 25.0)
    await queue.stop()


async def test_the_wait_estimate_follows_the_measured_admission_rate():
    clock = FakeClock()
    slots = Slots(0)
    queue = make_queue(slots, clock)
    tickets = [queue.enqueue(rid, FREE, 10) for rid in ("a", "b", "c")]
    order: list[str] = []
    for ticket in tickets[:2]:
        clock.advance(2.0)
        slots.num_free = 1
        queue.notify()
        await run_owner(ticket, slots, order)
    assert order == ["a", "b"]
    assert tickets[1].queue_time_s == pytest.approx(4.0)
    # two admissions 2 s apart; one still waits, so a newcomer is second in line
    assert queue.estimated_wait_s(FREE) == pytest.approx(4.0)
    await queue.stop()


async def test_cancel_releases_a_waiting_ticket_exactly_once():
    queue = make_queue(Slots(0))
    ticket = queue.enqueue("a", FREE, 30)
    other = queue.enqueue("b", FREE, 20)
    assert ticket.cancel() is True
    assert ticket.cancel() is False
    assert (queue.num_waiting, queue.num_waiting_tokens, queue.num_cancelled) == (1, 20, 1)
    assert ticket.position is None and other.position == 1
    with pytest.raises(QueueClosed):
        await ticket.wait(0)
    await queue.stop()


async def test_cancel_after_admission_is_harmless():
    slots = Slots(1)
    queue = make_queue(slots)
    ticket = queue.enqueue("a", FREE, 10)
    assert await ticket.wait() is True
    assert ticket.cancel() is False
    assert (queue.num_admitted, queue.num_cancelled, ticket.state) == (1, 0, TicketState.ADMITTED)


async def test_a_waiter_whose_task_is_cancelled_gives_up_its_place():
    queue = make_queue(Slots(0))
    ticket = queue.enqueue("a", FREE, 10)
    waiter = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ticket.state is TicketState.CANCELLED
    assert queue.num_waiting == 0 and queue.num_cancelled == 1
    await queue.stop()


async def test_wait_with_a_timeout_returns_false_and_keeps_the_place():
    queue = make_queue(Slots(0))
    queue.enqueue("e", ENTERPRISE, 10)
    ticket = queue.enqueue("f", FREE, 10)
    assert await ticket.wait(0.01) is False
    assert ticket.state is TicketState.WAITING and ticket.position == 2
    await queue.stop()


async def test_stop_fails_every_waiter_and_refuses_newcomers():
    queue = make_queue(Slots(0))
    tickets = [queue.enqueue(f"r{i}", FREE, 10) for i in range(3)]
    await queue.stop()
    for ticket in tickets:
        with pytest.raises(QueueClosed):
            await ticket.wait()
    with pytest.raises(QueueClosed):
        queue.enqueue("late", FREE, 10)
    assert queue.num_waiting == 0 and queue.num_waiting_tokens == 0
    assert not queue.can_take(ENTERPRISE, 1, 60.0)


async def test_a_failing_has_room_does_not_kill_the_dispatcher():
    calls = {"n": 0}

    def flaky_has_room() -> bool:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("stats unavailable")
        return calls["n"] > 3

    cfg = QueueConfig(max_waiting_requests=8, max_waiting_tokens=1000, max_wait_s=60.0, aging_s=10.0)
    queue = ModelQueue("mini", cfg, flaky_has_room, FakeClock(), poll_interval_s=0.01)
    ticket = queue.enqueue("a", FREE, 10)
    assert await asyncio.wait_for(ticket.wait(), 5.0) is True
    await queue.stop()


async def test_a_low_priority_estimate_counts_higher_priority_arrivals_that_will_cut_in():
    clock = FakeClock()
    queue = make_queue(Slots(0), clock, max_waiting_requests=100, max_wait_s=1000.0)
    queue.enqueue("f0", FREE, 10)
    for i in range(5):  # 5 enterprise arrivals at once: about 0.5 per second over the 10 s window
        queue.enqueue(f"e{i}", ENTERPRISE, 10)
    clock.advance(1.0)  # nothing admitted for 1 s: 1 s per admission
    assert queue.estimated_wait_s(ENTERPRISE) == pytest.approx(6.0)  # 5 ahead, nobody cuts in
    rate = 0.5 * math.exp(-0.1)
    # 6 ahead; enterprise requests arriving meanwhile go first (W = 7 + rate * W)
    assert queue.estimated_wait_s(FREE) == pytest.approx(7.0 / (1.0 - rate))
    await queue.stop()


async def test_cut_ins_stop_once_the_waiter_has_aged_past_the_higher_tier():
    clock = FakeClock()
    queue = make_queue(Slots(0), clock, max_waiting_requests=100, max_wait_s=1000.0)
    for i in range(30):  # 3 enterprise per second: more than the 1 per second served
        queue.enqueue(f"e{i}", ENTERPRISE, 10)
    clock.advance(1.0)
    rate = 3.0 * math.exp(-0.1)
    # cut-ins only during the 2 levels * 10 s it takes a free request to age past enterprise
    assert queue.estimated_wait_s(FREE) == pytest.approx(31.0 + rate * 20.0)
    await queue.stop()


async def test_without_aging_a_flooded_low_tier_has_no_wait_bound_and_is_refused():
    clock = FakeClock()
    queue = make_queue(Slots(0), clock, max_waiting_requests=100, max_wait_s=1000.0, aging_s=0.0)
    for i in range(30):
        queue.enqueue(f"e{i}", ENTERPRISE, 10)
    clock.advance(1.0)
    assert math.isinf(queue.estimated_wait_s(FREE))
    with pytest.raises(WaitTooLong) as info:
        queue.enqueue("f", FREE, 10)
    assert info.value.to_api_error().headers["Retry-After"] == "60"
    assert queue.estimated_wait_s(ENTERPRISE) == pytest.approx(31.0)
    await queue.stop()
