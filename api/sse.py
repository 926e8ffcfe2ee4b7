"""Server-sent events for chat streams: headers, `data:` frames, comments, `[DONE]`.

Every payload is JSON-encoded on one line (orjson escapes newlines), so model text such as
"\\n\\ndata: [DONE]\\n\\n" can never split a frame. A failed write means the client is gone:
it raises `ClientGone`, which the caller turns into an abort.
"""

from __future__ import annotations

import orjson
from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class ClientGone(Exception):
    """The client closed the connection."""


class SSEWriter:
    def __init__(self, response: web.StreamResponse):
        self._response = response

    @property
    def response(self) -> web.StreamResponse:
        """The prepared response the frames go to: what the handler returns to aiohttp."""
        return self._response

    @classmethod
    async def open(cls, request: web.Request, headers: dict[str, str]) -> SSEWriter:
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
        if request.version < (1, 1):  # no chunked encoding: the stream ends only when the connection does
            response.force_close()
        await response.prepare(request)
        return cls(response)

    async def data(self, payload: dict) -> None:
        await self._write(b"data: " + orjson.dumps(payload) + b"\n\n")

    async def comment(self, text: str) -> None:
        # Comments never carry model text: callers pass fixed, newline-free strings.
        await self._write(b": " + text.replace("\n", " ").encode() + b"\n\n")

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        try:
            await self._response.write_eof()
        except (ConnectionError, RuntimeError):
            pass

    async def end(self) -> None:
        """End the stream without `[DONE]` (the answer is incomplete or was not stored)."""
        try:
            await self._response.write_eof()
        except (ConnectionError, RuntimeError):
            pass

    async def _write(self, frame: bytes) -> None:
        try:
            await self._response.write(frame)
        except (ConnectionError, RuntimeError) as exc:  # reset, or transport already closed
            raise ClientGone() from exc
