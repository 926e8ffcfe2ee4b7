"""Reading one upstream SSE stream: `data:` payloads, with a deadline for the first chunk and
for the silence between chunks. Comments (`: ...`) and other SSE fields are skipped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson

DONE = object()  # the `data: [DONE]` sentinel


class MalformedStream(Exception):
    """A `data:` line that is not JSON."""


async def sse_payloads(
    response: aiohttp.ClientResponse, timeout_s: Callable[[], float]
) -> AsyncIterator[dict[str, Any] | object]:
    """Decoded `data:` payloads, then DONE. Raises TimeoutError when a line takes longer than
    `timeout_s()` (asked before every read: the caller's first-token or idle deadline)."""
    while True:
        async with asyncio.timeout(timeout_s()):
            line = await response.content.readline()
        if not line:
            return  # end of stream without [DONE]
        line = line.rstrip(b"\r\n")
        if not line.startswith(b"data:"):
            continue  # blank separator, comment, event:, id:, retry:
        data = line[5:].strip()
        if data == b"[DONE]":
            yield DONE
            return
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise MalformedStream(f"not JSON: {data[:80]!r}") from None
        if isinstance(payload, dict):
            yield payload
