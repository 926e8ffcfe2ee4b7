"""The chat requests being served, so that shutdown can wait for them and then cut them cleanly.

A chat handler runs inside `InFlight.track()`. On SIGTERM the runner waits for the set to
empty for the grace period, then `cut_all()` cancels the handlers that are left; each one sees
`was_cut()` and ends its answer with a `server_shutting_down` error (billed for what was
generated) instead of vanishing. Nothing here touches the network or the store.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from aiohttp import web


class InFlight:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._cut: set[asyncio.Task] = set()
        self._is_empty = asyncio.Event()
        self._is_empty.set()

    def __len__(self) -> int:
        return len(self._tasks)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._is_empty.clear()
        try:
            yield
        finally:
            self._tasks.discard(task)
            self._cut.discard(task)
            if not self._tasks:
                self._is_empty.set()

    def was_cut(self) -> bool:
        """True in a handler that `cut_all` cancelled (then it must answer, not re-raise)."""
        task = asyncio.current_task()
        if task in self._cut:
            task.uncancel()
            return True
        return False

    async def wait_empty(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._is_empty.wait()
            return True
        except TimeoutError:
            return False

    def cut_all(self) -> int:
        """Cancel every tracked handler; returns how many were cut."""
        for task in self._tasks:
            self._cut.add(task)
            task.cancel()
        return len(self._tasks)


INFLIGHT = web.AppKey("inflight", InFlight)
