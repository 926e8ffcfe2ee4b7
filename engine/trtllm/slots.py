"""The cap on requests inside TensorRT-LLM: a FIFO pool of slots whose waiters can be aborted.

Like an asyncio.Semaphore, but a waiter can be turned away by its request id (abort before
submission) and all waiters at once (shutdown). It does not know what a slot is used for.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict


class SlotPool:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.num_held = 0
        self._waiters: OrderedDict[str, asyncio.Future[bool]] = OrderedDict()

    @property
    def has_free(self) -> bool:
        return self.num_held < self.capacity and not self._waiters

    async def acquire(self, key: str) -> bool:
        """True once a slot is held (at once, without suspending, when one is free); False if turned away."""
        if self.has_free:
            self.num_held += 1
            return True
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters[key] = future
        try:
            return await future
        except asyncio.CancelledError:
            self._waiters.pop(key, None)
            if future.done() and not future.cancelled() and future.result():
                self.release()  # the slot was handed over just as the waiter was cancelled
            raise

    def turn_away(self, key: str) -> bool:
        """Make a waiting `acquire(key)` return False; False if `key` is not waiting."""
        future = self._waiters.pop(key, None)
        if future is None or future.done():
            return False
        future.set_result(False)
        return True

    def turn_away_all(self) -> None:
        for key in list(self._waiters):
            self.turn_away(key)

    def release(self) -> None:
        """Give a held slot back: to the oldest waiter, else to the pool."""
        while self._waiters:
            _, future = self._waiters.popitem(last=False)
            if not future.done():
                future.set_result(True)  # handed over: num_held is unchanged
                return
        self.num_held -= 1
