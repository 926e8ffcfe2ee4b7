"""Reading one upstream SSE stream: `data:` payloads, with a deadline for the first chunk and
for the silence between chunks. Comments (`: ...`) and other SSE fields are skipped and do not
count as chunks: an upstream that sends only keep-alive comments is silent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError

DONE = object()  # the `data: [DONE]` sentinel


class MalformedStream(Exception):
    """A `data:` line that is not JSON, or a line longer than the read buffer allows."""


async def sse_payloads(
    response: aiohttp.ClientResponse, timeout_s: Callable[[], float]
) -> AsyncIterator[dict[str, Any] | object]:
    """Decoded `data:` payloads, then DONE. Raises TimeoutError when a payload takes longer than
    `timeout_s()` (asked once per payload: the caller's first-token or idle deadline)."""
    loop = asyncio.get_running_loop()
    while True:
        deadline = loop.time() + timeout_s()  # comments and blank lines read before the payload do not extend it
        while True:
            async with asyncio.timeout_at(deadline):
                line = await _readline(response)
            if not line:
                return  # end of stream without [DONE]
            line = line.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                break
            # blank separator, comment, event:, id:, retry:
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


async def _readline(response: aiohttp.ClientResponse) -> bytes:
    try:
        return await response.content.readline()
    except HttpProcessingError as exc:  # LineTooLong: a line past the read buffer's high-water mark
        raise MalformedStream(f"a line too long to read ({type(exc).__name__})") from None
