"""Micro-batching of blocking work: callers on the event loop submit one job each; the jobs
that arrive while a batch runs go together in the next one, so N concurrent streams pay for
one classifier forward instead of N (and nothing waits for a timer when the load is light).

A batch takes its jobs when it starts running, not when it is handed to the executor: the
executor may hold it for a while (the native CPU engine runs it between two of its steps), and
every job that arrives meanwhile joins it instead of waiting for the batch after.

Owns only the pending jobs and their futures; what a batch does, and on which thread it
runs, belongs to the caller. Must not block the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Generic, TypeVar

J = TypeVar("J")
R = TypeVar("R")


class MicroBatcher(Generic[J, R]):
    """`run_batch(jobs) -> results` (same order) runs in `executor`, one batch at a time. A
    batch takes pending jobs in arrival order until their `weight` reaches `max_batch_weight`
    (always at least one), those for which `urgent(job)` is true before the others (so a flood
    of background work, such as many moderation inputs, never holds up a prompt's screening).
    A failed batch fails each of its jobs with the same exception."""

    def __init__(
        self,
        run_batch: Callable[[list[J]], Sequence[R]],
        executor: Callable[[], Executor],
        *,
        weight: Callable[[J], int],
        max_batch_weight: int,
        urgent: Callable[[J], bool] | None = None,
    ):
        self._run_batch = run_batch
        self._executor = executor
        self._weight = weight
        self._max_batch_weight = max_batch_weight
        self._urgent = urgent
        self._pending: list[tuple[J, asyncio.Future]] = []  # guarded by _lock (the batch's thread takes from it)
        self._lock = threading.Lock()
        self._drainer: asyncio.Task | None = None
        self.num_batches = 0  # batches run so far (metrics, tests)

    async def submit(self, job: J) -> R:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._pending.append((job, future))
        if self._drainer is None or self._drainer.done() or self._drainer.get_loop() is not loop:
            self._drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._has_pending():
            batch, results, error = await loop.run_in_executor(self._executor(), self._take_and_run)
            if batch:
                self.num_batches += 1
            for i, (_, future) in enumerate(batch):
                if future.done():  # a caller that was cancelled meanwhile gets nothing
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(results[i])

    def _has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def _take_and_run(self) -> tuple[list[tuple[J, asyncio.Future]], Sequence[R], Exception | None]:
        """On the executor's thread: take the next batch (the jobs pending now) and run it. The
        futures are only read here (a cancelled caller's job is left out); the event loop sets
        them."""
        batch = self._take()
        if not batch:
            return batch, [], None
        try:
            return batch, self._run_batch([job for job, _ in batch]), None
        except Exception as exc:  # handed to every caller of the batch
            return batch, [], exc

    def _take(self) -> list[tuple[J, asyncio.Future]]:
        """The next batch: pending jobs whose callers still wait, up to the weight limit."""
        with self._lock:
            live = [(job, future) for job, future in self._pending if not future.done()]
            if self._urgent is not None:  # stable: the urgent jobs, then the others, each in arrival order
                urgent = self._urgent
                live.sort(key=lambda pair: not urgent(pair[0]))
            total, n = 0, 0
            for job, _ in live:
                if n and total + self._weight(job) > self._max_batch_weight:
                    break
                total += self._weight(job)
                n += 1
            self._pending = live[n:]
        return live[:n]
