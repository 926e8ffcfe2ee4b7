"""The queue wait of one request as the client sees it: heartbeats with place and wait.

A streaming response opens only at its first queue comment (one heartbeat in), so a request
displaced or refused before that still gets a plain 503 with Retry-After. Each comment reads
`: queued position=N wait_s=M` (M: estimated seconds until it starts, rounded up).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from api.job import Job
from api.sse import SSEWriter
from api.state import AppState
from gateway.admission import Pass
from gateway.queue import QueueTicket


def queued_comment(ticket: QueueTicket) -> str:
    wait_s = ticket.estimated_wait_s
    text = f"queued position={ticket.position or 1}"
    return text if wait_s is None else f"{text} wait_s={math.ceil(wait_s)}"


async def wait_admitted(
    state: AppState, grant: Pass, job: Job, comment: Callable[[str], Awaitable[None]] | None
) -> None:
    """Wait for an engine reservation; `comment(text)` every heartbeat while waiting.

    Raises Overloaded when a higher tier takes the request's place.
    """
    interval_s = state.settings.server.heartbeat_s
    while not await grant.wait(interval_s):
        if comment is not None and grant.ticket is not None:
            await comment(queued_comment(grant.ticket))
    job.admitted_s = time.monotonic()


class LazyStream:
    """An SSE response that sends its headers on the first write (or `open()`)."""

    def __init__(
        self, request: web.Request, headers: Callable[[], dict[str, str]], writer_class: type[SSEWriter] = SSEWriter
    ):
        self._request = request
        self._headers = headers
        self._writer_class = writer_class  # Anthropic's Messages API names its events
        self._writer: SSEWriter | None = None

    @property
    def is_open(self) -> bool:
        return self._writer is not None

    async def open(self) -> SSEWriter:
        if self._writer is None:
            self._writer = await self._writer_class.open(self._request, self._headers())
        return self._writer

    async def comment(self, text: str) -> None:
        await (await self.open()).comment(text)
