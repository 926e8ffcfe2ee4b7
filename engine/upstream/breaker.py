"""The circuit breaker of one upstream replica: pure state, with the clock passed in.

Closed: requests flow. A refused or dropped connection, or `failure_threshold` consecutive
5xx answers or timeouts, opens it: no requests for `open_s`, then the replica is probed and,
if it answers, half-open: one request at a time until one succeeds (closed) or fails (open).
No I/O and no asyncio here; the backend does the probing.
"""

from __future__ import annotations

import enum


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class FailureKind(enum.Enum):
    CONNECTION = "connection"  # refused, reset, dropped mid-stream: the server is gone
    SERVER_ERROR = "server_error"  # a 5xx answer or an error event from the upstream
    TIMEOUT = "timeout"  # no first chunk, or silence between chunks, past the deadline


# Gauge values for /metrics (upstream_breaker_state).
BREAKER_GAUGE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class CircuitBreaker:
    __slots__ = ("failure_threshold", "open_s", "state", "num_failures", "opened_at_s", "num_opened")

    def __init__(self, failure_threshold: int, open_s: float):
        self.failure_threshold = max(1, failure_threshold)
        self.open_s = open_s
        self.state = BreakerState.CLOSED
        self.num_failures = 0  # consecutive, while closed
        self.opened_at_s: float | None = None
        self.num_opened = 0

    def record_success(self) -> None:
        self.state = BreakerState.CLOSED
        self.num_failures = 0
        self.opened_at_s = None

    def record_failure(self, kind: FailureKind, now_s: float) -> None:
        self.num_failures += 1
        if (
            self.state is BreakerState.HALF_OPEN
            or kind is FailureKind.CONNECTION
            or self.num_failures >= self.failure_threshold
        ):
            self._open(now_s)

    def probe_due(self, now_s: float) -> bool:
        """True when an open breaker has waited `open_s` and the replica should be probed."""
        return (
            self.state is BreakerState.OPEN and self.opened_at_s is not None and now_s - self.opened_at_s >= self.open_s
        )

    def probe_succeeded(self) -> None:
        if self.state is BreakerState.OPEN:
            self.state = BreakerState.HALF_OPEN

    def probe_failed(self, now_s: float) -> None:
        if self.state is BreakerState.OPEN:
            self.opened_at_s = now_s  # wait another open_s before the next probe

    def seconds_until_probe(self, now_s: float) -> float:
        if self.state is not BreakerState.OPEN or self.opened_at_s is None:
            return 0.0
        return max(0.0, self.open_s - (now_s - self.opened_at_s))

    def _open(self, now_s: float) -> None:
        if self.state is not BreakerState.OPEN:
            self.num_opened += 1
        self.state = BreakerState.OPEN
        self.opened_at_s = now_s
