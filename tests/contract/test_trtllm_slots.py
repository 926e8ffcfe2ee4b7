"""The in-flight cap's slot pool: FIFO hand-over, turning waiters away, cancellation safety."""

from __future__ import annotations

import asyncio

import pytest

from engine.trtllm.slots import SlotPool


async def test_a_free_slot_is_taken_without_suspending_and_the_pool_fills():
    pool = SlotPool(2)
    coro = pool.acquire("a")
    with pytest.raises(StopIteration) as done:  # completes on the first step: no await in between
        coro.send(None)
    assert done.value.value is True
    assert await pool.acquire("b") and not pool.has_free and pool.num_held == 2


async def test_released_slots_go_to_waiters_in_arrival_order():
    pool = SlotPool(1)
    await pool.acquire("first")
    order: list[str] = []

    async def wait(key: str) -> None:
        assert await pool.acquire(key)
        order.append(key)

    waiters = [asyncio.create_task(wait(k)) for k in ("second", "third")]
    await asyncio.sleep(0)
    pool.release()
    await asyncio.sleep(0)
    pool.release()
    await asyncio.gather(*waiters)
    assert order == ["second", "third"] and pool.num_held == 1


async def test_a_turned_away_waiter_gets_false_and_holds_nothing():
    pool = SlotPool(1)
    await pool.acquire("holder")
    waiter = asyncio.create_task(pool.acquire("late"))
    await asyncio.sleep(0)
    assert pool.turn_away("late") and not pool.turn_away("late")
    assert await waiter is False
    pool.release()
    assert pool.num_held == 0 and pool.has_free


async def test_a_waiter_cancelled_after_the_hand_over_gives_the_slot_back():
    pool = SlotPool(1)
    await pool.acquire("holder")
    waiter = asyncio.create_task(pool.acquire("late"))
    await asyncio.sleep(0)
    pool.release()  # handed to "late" ...
    waiter.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.num_held == 0 and pool.has_free
