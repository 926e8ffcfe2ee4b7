"""Connections: header and body deadlines, total and per-address caps, malformed HTTP in our envelopes.

aiohttp has no deadline for a request's headers or body and no connection cap, so a few hundred
slow clients can hold every slot. `GuardedHandler` (aiohttp's protocol, one per connection)
closes a connection whose headers do not arrive in time and renders parser errors in the
envelope of the path's API (the app's `error_body_for`: Ollama's on /api/, OpenAI's where no path
was read); `ConnectionGuard` admits connections under the caps, evicting the oldest idle one first;
`body_deadline_middleware` reads every body under its deadline before a handler sees it, but for
handlers marked `reads_body_itself` (chat completions), which refuse cheaply first and then read
it with `read_body` under the same deadline.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import orjson
import structlog
from aiohttp import web
from aiohttp.http import RawRequestMessage
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from api.errors import ApiError
from settings import ServerConfig

log = structlog.get_logger(__name__)

CLOSE_AFTER = web.RequestKey("close_after", bool)  # answer, then close the connection
LOG_EVERY_S = 5.0  # a biting cap is logged at most this often (with the count in between)
_EVICTABLE_AFTER_S = 5.0  # an answer the client has not read for this long may lose its slot to a new client
_SNIFF_BYTES = 64  # of a request's first line: its method and enough of its path to pick an error envelope
# The error body for a request path ("" when none was read): the app's renderer, api/app.py.
ErrorBody = Callable[[str, ApiError], dict]


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int  # after the fd reserve
    max_per_client: int
    header_timeout_s: float
    write_timeout_s: float = 30.0  # an answer whose bytes the client does not take for this long: closed

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> ConnectionLimits:
        """Raise the open-files limit to its hard maximum and keep `fd_reserve` descriptors spare."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        num_open = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
        fd_room = max(1, soft - num_open - cfg.fd_reserve)
        limits = cls(
            min(cfg.max_connections, fd_room), cfg.max_connections_per_client, cfg.header_timeout_s, cfg.write_timeout_s
        )
        if fd_room < cfg.max_connections:
            log.warning(
                "connection_cap_lowered_by_fd_limit",
                max_connections=limits.max_connections,
                configured=cfg.max_connections,
                open_files_limit=soft,
                fd_reserve=cfg.fd_reserve,
            )
        return limits


def _raw_error(status: int, reason: str, body_json: dict) -> bytes:
    """A whole HTTP/1.1 error response for a connection we will not hand to aiohttp."""
    body = orjson.dumps(body_json)
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """Counts connections in total and per peer address; admits, evicts or refuses, and says so."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._all: dict[GuardedHandler, str] = {}  # insertion order: oldest first
        self._by_peer: dict[str, dict[GuardedHandler, None]] = {}
        self._last_log_s: dict[str, float] = {}
        self._num_unlogged: dict[str, int] = {}

    @property
    def num_connections(self) -> int:
        return len(self._all)

    def sweep(self, now: float) -> int:
        """Close every connection whose answer the client has not read for write_timeout_s (a
        reader that stalls on purpose would otherwise hold its slot, and enough of them every
        slot: nothing else times out a write). Returns how many were closed."""
        stalled = [h for h in self._all if h.write_stalled(now, self.limits.write_timeout_s)]
        for handler in stalled:
            self.note("write_timeout", self._all.get(handler, "?"), action="closed")
            self.release(handler)
            handler.force_close()
        return len(stalled)

    async def sweep_forever(self, interval_s: float = 1.0) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval_s)
            self.sweep(loop.time())

    def admit(self, handler: GuardedHandler, peer: str) -> bool:
        peers = self._by_peer.setdefault(peer, {})
        if len(self._all) >= self.limits.max_connections and not self._evict("total", list(self._all), peer):
            return False
        if len(peers) >= self.limits.max_per_client and not self._evict("per_client", list(peers), peer):
            return False
        self._all[handler] = peer
        peers[handler] = None
        return True

    def release(self, handler: GuardedHandler) -> None:
        peer = self._all.pop(handler, None)
        if peer is None:
            return
        peers = self._by_peer.get(peer, {})
        peers.pop(handler, None)
        if not peers:
            self._by_peer.pop(peer, None)

    def _evict(self, cap: str, candidates: list[GuardedHandler], peer: str) -> bool:
        """Close the oldest connection that is idle or still sending its request; False if none."""
        victim = next((h for h in candidates if h.is_evictable), None)
        if victim is None:
            self.note(cap, peer, action="refused")
            return False
        self.note(cap, peer, action="closed_oldest_idle")
        self.release(victim)
        victim.force_close()
        return True

    def note(self, what: str, peer: str, *, action: str) -> None:
        """Log a cap or deadline that bit: the first time, then at most every LOG_EVERY_S seconds."""
        now = time.monotonic()
        if now - self._last_log_s.get(what, -LOG_EVERY_S) < LOG_EVERY_S:
            self._num_unlogged[what] = self._num_unlogged.get(what, 0) + 1
            return
        self._last_log_s[what] = now
        log.warning(
            "connection_limit",
            limit=what,
            action=action,
            peer=peer,
            num_connections=len(self._all),
            max_connections=self.limits.max_connections,
            max_per_client=self.limits.max_per_client,
            num_since_last_log=self._num_unlogged.pop(what, 0),
        )


def _target_path(head: bytes | bytearray) -> str:
    """The path of a request line's target (the start of it), or "" when it has none."""
    parts = head.lstrip(b"\r\n").split(b" ", 2)
    if len(parts) < 2 or not parts[1].startswith(b"/"):
        return ""
    return parts[1].split(b"?", 1)[0].decode("latin-1")


class GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol with admission, a header deadline and envelope errors."""

    def __init__(self, manager, *, guard: ConnectionGuard, error_body: ErrorBody, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._error_body = error_body
        # aiohttp's parser errors lose the request: its path is read from these first bytes of the head being
        # parsed (after a pipelined request in the same packet: none, OpenAI's envelope).
        self._head = bytearray()
        self._body: StreamReader | None = None  # of the last request whose head was parsed
        self._peer = "?"
        self._is_admitted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self.is_reading_body = False
        self._unsent = 0  # bytes of answers the transport held at the last look
        self._write_progress_s = self._loop.time()  # when the client last took some

    @property
    def is_evictable(self) -> bool:
        """Idle between requests, still sending headers, stuck sending its body, or not reading its
        answer (its unsent bytes have not gone down since the last sweep)."""
        return (
            self.is_reading_body
            or (not self._request_in_progress and not self._messages)
            or (self._unsent > 0 and self._loop.time() - self._write_progress_s > _EVICTABLE_AFTER_S)
        )

    @property
    def _is_between_requests(self) -> bool:
        """No request answered or queued, and the last one's body all in (one its answer left unread
        is drained after the answer, aiohttp's lingering): the next byte starts a request."""
        body_done = self._body is None or self._body.is_eof()
        return not self._request_in_progress and not self._messages and body_done

    def write_stalled(self, now: float, timeout_s: float) -> bool:
        """Whether answer bytes have waited for the client longer than `timeout_s` without it
        taking any (looked at once per sweep: a buffer that shrank or emptied is progress)."""
        transport = self.transport
        unsent = transport.get_write_buffer_size() if transport is not None else 0
        if unsent == 0 or unsent < self._unsent:
            self._write_progress_s = now
        self._unsent = unsent
        return unsent > 0 and now - self._write_progress_s > timeout_s

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        self._peer = str(peername[0]) if peername else "?"
        if not self._guard.admit(self, self._peer):
            error = ApiError(503, "Too many connections; try again shortly.", "server_error", "too_many_connections")
            # A stream transport (uvloop's does not subclass asyncio.WriteTransport): it has write().
            # No byte of a request was read: no path, OpenAI's envelope.
            cast(asyncio.Transport, transport).write(_raw_error(503, "Service Unavailable", error.body()))
            transport.close()
            return
        self._is_admitted = True
        super().connection_made(transport)
        self._start_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._is_admitted:
            return
        self._cancel_header_timer()
        self._guard.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # b"": aiohttp resuming its parser (a body or the pipeline drained), no byte from the client.
        if data and self._is_between_requests and self._header_timer is None:
            self._start_header_timer()  # the first bytes of a (next) request
        if (self._body is None or self._body.is_eof()) and len(self._head) < _SNIFF_BYTES:
            self._head += data[: _SNIFF_BYTES - len(self._head)]  # bytes of a head, not of a body
        num_messages = len(self._messages)
        super().data_received(data)
        for message, body in list(self._messages)[num_messages:]:
            if isinstance(message, RawRequestMessage):
                self._head.clear()
                self._body = body
            elif self._body is not None and not self._body.is_eof():
                # A body that stops parsing after its head arrived (a bad chunk size): aiohttp queues the error
                # as a next request, and the handler's read waited for the body deadline (408). The read fails
                # now (400 in the path's envelope); the connection closes after the answer, not lingering. On
                # the next turn of the loop: a chunk's end in this packet woke the read already, and it waits
                # again without looking for an exception.
                self._lingering_time = 0.0
                self._loop.call_soon(self._body.set_exception, message.exc)
        if self._messages:  # a whole request head arrived
            self._cancel_header_timer()

    def _start_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._request_in_progress or self._messages or self.transport is None:
            return
        self._guard.note("header_timeout", self._peer, action="closed")
        error = ApiError(
            408,
            f"The request headers did not arrive within {self._guard.limits.header_timeout_s:g} s.",
            "invalid_request_error",
            "request_timeout",
        )
        self.transport.write(_raw_error(408, "Request Timeout", self._error_body(_target_path(self._head), error)))
        self.force_close()

    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """Malformed HTTP (aiohttp's parser, whose `request` has no path: the head's first bytes have it)
        and unexpected failures, in the envelope of the path's API."""
        if status >= 500:
            log.error("http_error", peer=self._peer, status=status, error=repr(exc))
            error = ApiError(
                status, "The server had an error while processing your request.", "server_error", "internal_error"
            )
            path = request.path
        else:
            text = message or (exc.message if isinstance(exc, HttpProcessingError) else str(exc)) or "Bad request"
            log.warning("malformed_http", peer=self._peer, status=status, error=text[:200])
            error = ApiError(status, f"Malformed HTTP request: {text[:200]}", "invalid_request_error", "malformed_http")
            path = _target_path(self._head)  # aiohttp's stand-in request for a parser error has none
        body = self._error_body(path, error)
        response = web.json_response(body, status=status, headers={"Server": "selfhosted-chat"})
        response.force_close()
        return response


def make_protocol_factory(server: web.Server, guard: ConnectionGuard, error_body: ErrorBody, **kwargs):
    """What `loop.create_server` calls per connection: aiohttp's handler, guarded, rendering its
    errors with `error_body` (the app's, which picks the envelope by path)."""
    handler_kwargs = {**server._kwargs, **kwargs}  # the runner's settings (access log, debug, limits)

    def factory() -> GuardedHandler:
        return GuardedHandler(
            server, loop=asyncio.get_running_loop(), guard=guard, error_body=error_body, **handler_kwargs
        )

    return factory


# What a client with a large body can do instead (a data: URL image or file inflates a body by a third).
BIG_BODY_HINT = "Send large images and files with POST /v1/files and refer to them by file_id."


def reads_body_itself(handler):
    """Mark a handler that may answer before reading its body (a load or rate refusal) and
    reads it with `read_body`; the middleware then leaves the body to it."""
    handler.reads_body_itself = True
    return handler


def make_body_deadline_middleware(cfg: ServerConfig):
    """Read a body whole, under `body_timeout_s`, after auth and before any handler (413 first)."""

    @web.middleware
    async def body_deadline_middleware(request: web.Request, handler) -> web.StreamResponse:
        if request.can_read_body and request.content_type.startswith("multipart/"):
            return await _streamed_upload(request, handler)  # the Files API streams it to disk
        if request.can_read_body:
            if request.content_length is not None and request.content_length > cfg.max_body_bytes:
                request[CLOSE_AFTER] = True
                raise ApiError(
                    413,
                    f"The request body is too large ({request.content_length} bytes declared; "
                    f"the limit is {cfg.max_body_bytes}, server.max_body_bytes). {BIG_BODY_HINT}",
                    "invalid_request_error",
                    "request_too_large",
                )
            if not getattr(request.match_info.handler, "reads_body_itself", False):
                await read_body(request, cfg.body_timeout_s)
        return await handler(request)

    return body_deadline_middleware


async def _streamed_upload(request: web.Request, handler) -> web.StreamResponse:
    """An upload is read by its handler, with its own size limits and idle deadline (api/files.py);
    under a connection cap it may be closed."""
    protocol = request.protocol
    if isinstance(protocol, GuardedHandler):
        protocol.is_reading_body = True
    try:
        return await handler(request)
    finally:
        if isinstance(protocol, GuardedHandler):
            protocol.is_reading_body = False


def malformed_body(request: web.Request, exc: HttpProcessingError | RequestPayloadError) -> ApiError:
    """The 400 for a body that cannot be read as HTTP says: bad chunking or length, or a
    `Content-Encoding` (gzip, deflate) whose bytes do not decode. The connection closes after it."""
    request[CLOSE_AFTER] = True
    cause = exc.__cause__ if isinstance(exc, RequestPayloadError) else exc  # the decoder's own error
    message = (cause.message if isinstance(cause, HttpProcessingError) else str(exc))[:200]
    log.warning("malformed_http", peer=request.remote, error=message)
    return ApiError(400, f"Malformed request body: {message}", "invalid_request_error", "malformed_http")


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, read under `timeout_s` (408 and close past it); cached on the request."""
    protocol = request.protocol
    if isinstance(protocol, GuardedHandler):
        protocol.is_reading_body = True
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()  # cached on the request: handlers read it again for free
    except TimeoutError:
        request[CLOSE_AFTER] = True
        log.warning("body_timeout", peer=request.remote, timeout_s=timeout_s)
        raise ApiError(
            408, f"The request body did not arrive within {timeout_s:g} s.", "invalid_request_error", "request_timeout"
        ) from None
    except (HttpProcessingError, RequestPayloadError) as exc:  # bad chunking or length; undecodable encoding
        raise malformed_body(request, exc) from None
    finally:
        if isinstance(protocol, GuardedHandler):
            protocol.is_reading_body = False
