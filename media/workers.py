"""Where blocking media work runs: a thread pool of its own, and slots that bound each kind of work.

Decoding images and reading text files and the extraction cache block, so they run on
`run_blocking` (the media threads), never on the event loop's default executor: uploads commit
there and shutdown waits for it, and long work once filled it and hung both. `Slots` bounds how
many of one kind of work run at once (image decodes, PDF child processes); the rest wait.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# A ceiling for all media work together; Slots bound the long kinds below it.
_NUM_THREADS = 8
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _media_executor() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(_NUM_THREADS, "media")
        return _executor


async def run_blocking(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a media thread. Cancelling the caller drops it if it has not started yet."""
    return await asyncio.get_running_loop().run_in_executor(_media_executor(), fn, *args)


class Slots:
    """At most `size` holders at once. An asyncio.Semaphore belongs to the event loop it first
    waits on, so each loop gets its own (a server has one; tests start one per test); a changed
    size also starts a new one."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._size = 0
        self._semaphore = asyncio.Semaphore(0)

    def semaphore(self, size: int) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop is not self._loop or size != self._size:
            self._loop, self._size, self._semaphore = loop, size, asyncio.Semaphore(max(size, 1))
        return self._semaphore
