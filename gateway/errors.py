"""Why the gateway refuses a request, as plain values: a reason, a message, a retry delay.

Nothing here knows HTTP. `api/errors.py` maps every `Reason` to a status, OpenAI's error
envelope and headers in one table; gateway code raises these types and never an ApiError.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

MAX_RETRY_AFTER_S = 60.0  # the openai SDK waits at most 60 s (v1) for a Retry-After


class Reason(enum.Enum):
    # the caller's own limits (rate limited)
    KEY_REQUESTS = "key_requests"
    KEY_TOKENS = "key_tokens"
    TIER_REQUESTS = "tier_requests"
    TIER_TOKENS = "tier_tokens"
    CONCURRENT_STREAMS = "concurrent_streams"
    REQUEST_TOO_LARGE = "request_too_large"  # the estimate exceeds a bucket's whole capacity
    # the server's load (overloaded)
    QUEUE_FULL = "queue_full"  # every place is held by someone at least as urgent
    WAIT_TOO_LONG = "queue_wait_too_long"  # shed: the estimated wait passes the tier's target
    DISPLACED = "queue_displaced"  # a more urgent request took this one's place
    SHUTTING_DOWN = "server_shutting_down"
    MODEL_UNAVAILABLE = "model_unavailable"  # the backend cannot be reached (every upstream replica down)
    # the caller's plan
    OVER_QUOTA = "insufficient_quota"
    MODEL_NOT_FOUND = "model_not_found"
    TIER_NOT_ENABLED = "tier_not_enabled"


RATE_LIMIT_REASONS = frozenset(
    {
        Reason.KEY_REQUESTS,
        Reason.KEY_TOKENS,
        Reason.TIER_REQUESTS,
        Reason.TIER_TOKENS,
        Reason.CONCURRENT_STREAMS,
        Reason.REQUEST_TOO_LARGE,
    }
)
LOAD_REASONS = frozenset(
    {
        Reason.QUEUE_FULL,
        Reason.WAIT_TOO_LONG,
        Reason.DISPLACED,
        Reason.SHUTTING_DOWN,
        Reason.MODEL_UNAVAILABLE,
    }
)


@dataclass(frozen=True, slots=True)
class BucketView:
    """One dimension of a caller's limits, for OpenAI's x-ratelimit-* headers."""

    unit: str  # "requests" or "tokens"
    limit: int
    remaining: float
    reset_s: float


class GatewayError(Exception):
    """A refusal before any stream opens; `reason` decides how the API renders it."""

    def __init__(
        self,
        reason: Reason,
        message: str,
        *,
        retry_after_s: float | None = None,
        buckets: tuple[BucketView, ...] = (),
        param: str | None = None,
    ):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s
        self.buckets = buckets
        self.param = param

    @property
    def should_retry(self) -> bool:
        return self.reason not in (Reason.REQUEST_TOO_LARGE, Reason.OVER_QUOTA)


class RateLimited(GatewayError):
    """The caller's request or token bucket, or its concurrent-stream cap: a 429."""


class Overloaded(GatewayError):
    """The server's queue cannot take the request now: a 503 with Retry-After."""

    def __init__(
        self,
        reason: Reason,
        message: str,
        *,
        retry_after_s: float = 1.0,
        num_outranked_waiting: int = 0,
        num_below_waiting: int = 0,
    ):
        super().__init__(reason, message, retry_after_s=clamp_retry_after_s(retry_after_s))
        self.num_outranked_waiting = num_outranked_waiting  # lower-tier requests waiting (aged past it)
        self.num_below_waiting = num_below_waiting  # requests of lower effective priority waiting


class OverQuota(GatewayError):
    """The organisation spent its budget; retrying does not help."""

    def __init__(self, message: str):
        super().__init__(Reason.OVER_QUOTA, message)


class NotFound(GatewayError):
    """A model the caller's tier does not have (or that does not exist: the same answer)."""


class NotEnabled(GatewayError):
    """The caller's tier serves no model on this server."""


def clamp_retry_after_s(seconds: float) -> float:
    """Between 1 s and MAX_RETRY_AFTER_S; an unbounded estimate becomes the maximum."""
    if math.isnan(seconds):
        return MAX_RETRY_AFTER_S
    return min(max(1.0, seconds), MAX_RETRY_AFTER_S)
