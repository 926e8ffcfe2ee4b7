"""Micro-batching of blocking work: callers on the event loop submit one job each; the jobs
that arrive while a batch runs go together in the next one, so N concurrent streams pay for
one classifier forward instead of N (and nothing waits for a timer when the load is light).

Owns only the pending jobs and their futures; what a batch does, and on which thread it
runs, belongs to the caller. Must not block the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Generic, TypeVar

J = TypeVar("J")
R = TypeVar("R")


class MicroBatcher(Generic[J, R]):
    """`run_batch(jobs) -> results` (same order) runs in `executor`, one batch at a time. A
    batch takes pending jobs in arrival order until their `weight` reaches `max_batch_weight`
    (always at least one). A failed batch fails each of its jobs with the same exception."""

    def __init__(
        self,
        run_batch: Callable[[list[J]], Sequence[R]],
        executor: Callable[[], Executor],
        *,
        weight: Callable[[J], int],
        max_batch_weight: int,
    ):
        self._run_batch = run_batch
        self._executor = executor
        self._weight = weight
        self._max_batch_weight = max_batch_weight
        self._pending: list[tuple[J, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self.num_batches = 0  # batches run so far (metrics, tests)

    async def submit(self, job: J) -> R:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((job, future))
        if self._drainer is None or self._drainer.done() or self._drainer.get_loop() is not loop:
            self._drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch = self._take()
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self._executor(), self._run_batch, [job for job, _ in batch])
            except Exception as exc:  # handed to every caller of the batch
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            finally:
                self.num_batches += 1
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():  # a caller that was cancelled meanwhile gets nothing
                    future.set_result(result)

    def _take(self) -> list[tuple[J, asyncio.Future]]:
        """The next batch: pending jobs whose callers still wait, up to the weight limit."""
        live = [(job, future) for job, future in self._pending if not future.done()]
        total, n = 0, 0
        for job, _ in live:
            if n and total + self._weight(job) > self._max_batch_weight:
                break
            total += self._weight(job)
            n += 1
        self._pending = live[n:]
        return live[:n]
