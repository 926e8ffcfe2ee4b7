"""The asyncio ModelQueue: tickets around the WaitingRoom, release, displacement, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import Overloaded, Reason
from gateway.queue import ModelQueue, TicketState
from gateway.waiting_room import Offer
from settings import QueueConfig
from tests.gateway.fakes import FakeClock

pytestmark = pytest.mark.asyncio
FREE, PLUS, ENTERPRISE = 0, 1, 2


def make_queue(capacity: int = 1, has_room=lambda: True, clock=None, **config) -> ModelQueue:
    cfg = QueueConfig(
        **{"max_waiting_requests": 8, "max_waiting_tokens": 1000, "max_wait_s": 60.0, "aging_s": 10.0, **config}
    )
    return ModelQueue("mini", cfg, has_room, clock or FakeClock(), capacity=capacity, poll_interval_s=0.01)


def enqueue(queue: ModelQueue, request_id: str, priority: int = FREE, num_tokens: int = 10):
    return queue.enqueue(Offer(request_id, priority, num_tokens))


async def test_tickets_are_admitted_at_once_while_reservations_last():
    queue = make_queue(capacity=2)
    tickets = [enqueue(queue, f"r{i}") for i in range(3)]
    assert [t.state for t in tickets] == [TicketState.ADMITTED, TicketState.ADMITTED, TicketState.WAITING]
    assert await tickets[0].wait(0) is True and tickets[0].queue_time_s == 0.0
    assert await tickets[2].wait(0.01) is False and tickets[2].position == 1
    assert queue.num_reserved == 2


async def test_a_release_admits_the_next_waiter_by_priority_at_once():
    queue = make_queue(capacity=1)
    running = enqueue(queue, "run")
    waiters = [enqueue(queue, rid, prio) for rid, prio in [("f1", FREE), ("e1", ENTERPRISE), ("p1", PLUS)]]
    assert [t.position for t in waiters] == [3, 1, 2]
    order = []
    for ticket in (running, waiters[1], waiters[2]):
        ticket.release()
        order += [t.request_id for t in waiters if t.state is TicketState.ADMITTED and t.request_id not in order]
    assert order == ["e1", "p1", "f1"]
    assert queue.num_reserved == 1


async def test_a_burst_of_owners_never_holds_more_reservations_than_capacity():
    queue = make_queue(capacity=2, max_waiting_requests=16)
    in_engine = 0
    most = 0

    async def owner(request_id: str) -> None:
        nonlocal in_engine, most
        ticket = enqueue(queue, request_id)
        assert await ticket.wait()
        in_engine += 1
        most = max(most, in_engine)
        await asyncio.sleep(0.005)
        in_engine -= 1
        ticket.release()

    await asyncio.gather(*(owner(f"r{i}") for i in range(12)))
    assert most == 2 and queue.num_reserved == 0 and queue.num_waiting == 0


async def test_a_displaced_waiter_fails_with_a_retry_after():
    queue = make_queue(capacity=1, max_waiting_requests=1)
    enqueue(queue, "run")
    free = enqueue(queue, "free", FREE)
    enterprise = enqueue(queue, "enterprise", ENTERPRISE)
    with pytest.raises(Overloaded) as info:
        await free.wait(1.0)
    assert info.value.reason is Reason.DISPLACED and info.value.retry_after_s >= 1.0
    assert enterprise.position == 1
    free.release()  # the owner's release after a displacement is harmless
    assert queue.num_waiting == 1


async def test_a_full_queue_refuses_with_queue_full():
    queue = make_queue(capacity=1, max_waiting_requests=1)
    enqueue(queue, "run", ENTERPRISE)
    enqueue(queue, "e1", ENTERPRISE)
    with pytest.raises(Overloaded) as info:
        enqueue(queue, "e2", ENTERPRISE)
    assert info.value.reason is Reason.QUEUE_FULL


async def test_a_waiter_whose_task_is_cancelled_gives_up_its_place():
    queue = make_queue(capacity=1)
    enqueue(queue, "run")
    ticket = enqueue(queue, "a")
    waiter = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ticket.state is TicketState.RELEASED
    assert queue.num_waiting == 0 and queue.room.num_cancelled == 1


async def test_stop_fails_every_waiter_and_refuses_newcomers():
    queue = make_queue(capacity=1)
    enqueue(queue, "run")
    tickets = [enqueue(queue, f"r{i}") for i in range(3)]
    await queue.stop()
    for ticket in tickets:
        with pytest.raises(Overloaded) as info:
            await ticket.wait()
        assert info.value.reason is Reason.SHUTTING_DOWN
    with pytest.raises(Overloaded):
        enqueue(queue, "late")
    assert queue.num_waiting == 0 and queue.room.num_waiting_tokens == 0


async def test_a_backend_without_room_is_polled_until_it_has_some():
    room = {"free": False}
    queue = make_queue(capacity=4, has_room=lambda: room["free"])
    ticket = enqueue(queue, "a")
    assert ticket.state is TicketState.WAITING
    room["free"] = True
    assert await asyncio.wait_for(ticket.wait(), 5.0) is True
    await queue.stop()


async def test_a_failing_has_room_does_not_stop_admission():
    def broken() -> bool:
        raise RuntimeError("stats unavailable")

    queue = make_queue(capacity=1, has_room=broken)
    assert await enqueue(queue, "a").wait(0) is True


async def test_waiting_requests_get_a_503_when_the_engine_dies_instead_of_waiting_forever():
    """A dead native engine never has room again: its waiters were held until the client gave up."""
    alive = True
    cfg = QueueConfig(max_waiting_requests=8, max_waiting_tokens=1000, max_wait_s=60.0, aging_s=10.0)
    queue = ModelQueue(
        "mini", cfg, lambda: False, FakeClock(), capacity=1, poll_interval_s=0.01, is_available=lambda: alive
    )
    running, waiting = enqueue(queue, "run"), enqueue(queue, "wait")
    assert waiting.state is TicketState.WAITING
    alive = False
    with pytest.raises(Overloaded) as refused:
        await asyncio.wait_for(waiting.wait(), timeout=2)
    assert refused.value.reason is Reason.MODEL_UNAVAILABLE and queue.num_waiting == 0
    running.release()
