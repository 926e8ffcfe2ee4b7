"""Token buckets per API key and per tier, and per-key concurrent-stream tickets.

Owns the admission-time debit (first an estimate from the body's size, topped up to prompt +
max_tokens once tokenized), its exactly-once settlement against the real counts, and the
bucket levels behind OpenAI's `x-ratelimit-*` headers. Knows nothing of HTTP or the store:
the caller passes the tier and any per-organisation overrides. All times come from `clock`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType

import structlog

from gateway.errors import BucketView, RateLimited, Reason
from settings import ORG_LIMITS, TierConfig

log = structlog.get_logger(__name__)

Clock = Callable[[], float]
_PERIOD_S = 60.0  # every limit is "per minute": a bucket refills its capacity in 60 s
_OVERRIDABLE = frozenset(ORG_LIMITS)  # per key, per org


RateLimitReason = Reason  # the bucket reasons are gateway.errors.Reason members
_TOKEN_REASONS = frozenset({Reason.KEY_TOKENS, Reason.TIER_TOKENS})


class TokenBucket:
    """`capacity` units refilled continuously at `refill_per_s`.

    The level never drops below zero through `take`; only `settle` with a real cost above
    the estimate may push it negative (the overdraft is then paid back by the refill).
    """

    __slots__ = ("capacity", "refill_per_s", "_level", "_updated_s", "_clock")

    def __init__(self, capacity: float, refill_per_s: float, clock: Clock = time.monotonic):
        if capacity <= 0 or refill_per_s <= 0:
            raise ValueError(f"bucket needs capacity > 0 and refill > 0, got {capacity}, {refill_per_s}")
        self.capacity = float(capacity)
        self.refill_per_s = float(refill_per_s)
        self._clock = clock
        self._level = self.capacity
        self._updated_s = clock()

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    def retry_after_s(self, need: float) -> float:
        """Seconds until `need` units are available: 0 now, `inf` if it exceeds capacity."""
        if need > self.capacity:
            return math.inf
        self._refill()
        return max(0.0, (need - self._level) / self.refill_per_s)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's `x-ratelimit-reset-*`)."""
        self._refill()
        return max(0.0, (self.capacity - self._level) / self.refill_per_s)

    def take(self, need: float) -> None:
        if self.retry_after_s(need) > 0:
            raise ValueError(f"take({need}) with only {self._level:.3f} available")
        self._level -= need

    def settle(self, refund: float) -> None:
        """Give back `refund` units (negative: charge more, possibly below zero)."""
        self._refill()
        self._level = min(self.capacity, self._level + refund)

    def resize(self, capacity: float, refill_per_s: float) -> None:
        """New limits keep the amount already used, so a change never grants a fresh burst."""
        self._refill()
        used = self.capacity - self._level
        self.capacity, self.refill_per_s = float(capacity), float(refill_per_s)
        self._level = self.capacity - used

    def _refill(self) -> None:
        now = self._clock()
        elapsed_s = now - self._updated_s
        if elapsed_s > 0:
            self._level = min(self.capacity, self._level + elapsed_s * self.refill_per_s)
        self._updated_s = now


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-minute limits in force for one key; 0 means no limit on that dimension."""

    requests_per_minute: int
    tokens_per_minute: int
    tier_requests_per_minute: int
    tier_tokens_per_minute: int

    @classmethod
    def for_tier(cls, tier: TierConfig, overrides: Mapping[str, float] | None = None) -> Limits:
        """The tier's limits with an organisation's overrides (other tier settings in the
        overrides, such as max_tokens, are someone else's and are ignored here)."""
        overrides = {k: v for k, v in (overrides or {}).items() if k in _OVERRIDABLE}
        return cls(
            requests_per_minute=int(overrides.get("requests_per_minute", tier.requests_per_minute)),
            tokens_per_minute=int(overrides.get("tokens_per_minute", tier.tokens_per_minute)),
            tier_requests_per_minute=tier.tier_requests_per_minute,
            tier_tokens_per_minute=tier.tier_tokens_per_minute,
        )


# A bucket's identity: ("key", api_key, "requests") or ("tier", tier_name, "tokens").
BucketId = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class _Check:
    reason: RateLimitReason
    bucket_id: BucketId
    capacity: int
    need: int


class Reservation:
    """What one admitted request took from the buckets; settled or cancelled exactly once."""

    __slots__ = ("key", "tier_name", "num_tokens_reserved", "_checks", "_limits", "is_settled")

    def __init__(self, key: str, tier_name: str, num_tokens_reserved: int, checks: tuple[_Check, ...], limits: Limits):
        self.key = key
        self.tier_name = tier_name
        self.num_tokens_reserved = num_tokens_reserved
        self._checks = checks
        self._limits = limits
        self.is_settled = False


class StreamTicket:
    """One of a key's concurrent streams; `release()` (or leaving the `with`) frees it once."""

    __slots__ = ("_limiter", "key", "is_released")

    def __init__(self, limiter: RateLimiter, key: str):
        self._limiter = limiter
        self.key = key
        self.is_released = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._limiter._close_stream(self.key)

    def __enter__(self) -> StreamTicket:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class RateLimiter:
    """Request and token buckets per key and per tier, plus per-key stream counts.

    Buckets are created on first use; full ones are dropped now and then, since a full
    bucket is the same as a fresh one.
    """

    def __init__(self, clock: Clock = time.monotonic, prune_every: int = 1024):
        self._clock = clock
        self._buckets: dict[BucketId, TokenBucket] = {}
        self._num_streams: dict[str, int] = {}
        self._prune_every = prune_every
        self._num_acquires = 0

    def acquire(
        self,
        key: str,
        tier_name: str,
        tier: TierConfig,
        num_tokens_reserved: int,
        overrides: Mapping[str, float] | None = None,
    ) -> Reservation:
        """Debit one request and `num_tokens_reserved` from every bucket, or none and raise RateLimited."""
        limits = Limits.for_tier(tier, overrides)
        checks = _checks_for(key, tier_name, limits, num_tokens_reserved)
        self._raise_if_limited(key, tier_name, limits, checks)
        for check in checks:
            self._bucket(check).take(check.need)
        self._num_acquires += 1
        if self._num_acquires % self._prune_every == 0:
            self.prune()
        return Reservation(key, tier_name, num_tokens_reserved, checks, limits)

    def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Refund estimate minus actual tokens (or charge the excess); a second call is a no-op."""
        if reservation.is_settled:
            return
        reservation.is_settled = True
        refund = reservation.num_tokens_reserved - actual_tokens
        for check in reservation._checks:
            if check.reason in (Reason.KEY_TOKENS, Reason.TIER_TOKENS):
                self._bucket(check).settle(refund)

    def top_up(self, reservation: Reservation, num_tokens: int) -> None:
        """Move a reservation's token debit from its first estimate to `num_tokens`.

        The body-size estimate is taken before parsing; once tokenized, the request owes
        prompt + max_tokens. Raises RateLimited (changing nothing) if the extra is not there.
        """
        extra = num_tokens - reservation.num_tokens_reserved
        checks = [c for c in reservation._checks if c.reason in _TOKEN_REASONS]
        if extra > 0:
            waits = [(math.inf if num_tokens > c.capacity else self._bucket(c).retry_after_s(extra), c) for c in checks]
            if waits:
                retry_after_s, worst = max(waits, key=lambda w: w[0])
                if retry_after_s > 0:
                    raise self._refusal(
                        dataclasses.replace(worst, need=num_tokens),
                        retry_after_s,
                        reservation.key,
                        reservation.tier_name,
                        reservation._limits,
                    )
        for check in checks:
            self._bucket(check).settle(-extra)
        reservation.num_tokens_reserved = num_tokens
        reservation._checks = tuple(
            dataclasses.replace(c, need=num_tokens) if c.reason in _TOKEN_REASONS else c for c in reservation._checks
        )

    def cancel(self, reservation: Reservation) -> None:
        """The request was never served (e.g. a 503 after admission): refund everything, once."""
        if reservation.is_settled:
            return
        reservation.is_settled = True
        for check in reservation._checks:
            self._bucket(check).settle(check.need)

    def buckets(
        self, key: str, tier_name: str, tier: TierConfig, overrides: Mapping[str, float] | None = None
    ) -> tuple[BucketView, ...]:
        """The tightest bucket of each dimension (for OpenAI's x-ratelimit-* headers)."""
        return self._views(key, tier_name, Limits.for_tier(tier, overrides))

    def open_stream(self, key: str, limit: int) -> StreamTicket:
        """Claim one of the key's `limit` concurrent streams (0: unlimited) or raise RateLimited."""
        num_open = self._num_streams.get(key, 0)
        if limit > 0 and num_open >= limit:
            message = f"Too many concurrent requests for this API key (limit {limit}); wait for one to finish."
            raise RateLimited(Reason.CONCURRENT_STREAMS, message, retry_after_s=1.0)
        self._num_streams[key] = num_open + 1
        return StreamTicket(self, key)

    def num_streams(self, key: str) -> int:
        return self._num_streams.get(key, 0)

    def prune(self) -> None:
        """Forget full buckets (identical to fresh ones); keeps memory bounded by active keys."""
        full = [bid for bid, bucket in self._buckets.items() if bucket.level >= bucket.capacity]
        for bid in full:
            del self._buckets[bid]

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def _close_stream(self, key: str) -> None:
        num_open = self._num_streams.get(key, 0) - 1
        if num_open > 0:
            self._num_streams[key] = num_open
        else:
            self._num_streams.pop(key, None)

    def _raise_if_limited(self, key: str, tier_name: str, limits: Limits, checks: tuple[_Check, ...]) -> None:
        waits = [(self._bucket(c).retry_after_s(c.need), c) for c in checks]
        if waits:
            retry_after_s, worst = max(waits, key=lambda w: w[0])
            if retry_after_s > 0:
                raise self._refusal(worst, retry_after_s, key, tier_name, limits)

    def _bucket(self, check: _Check) -> TokenBucket:
        refill_per_s = check.capacity / _PERIOD_S
        bucket = self._buckets.get(check.bucket_id)
        if bucket is None:
            bucket = self._buckets[check.bucket_id] = TokenBucket(check.capacity, refill_per_s, self._clock)
        elif bucket.capacity != check.capacity:
            bucket.resize(check.capacity, refill_per_s)
        return bucket

    def _refusal(self, check: _Check, retry_after_s: float, key: str, tier_name: str, limits: Limits) -> RateLimited:
        views = self._views(key, tier_name, limits)
        scope = "this API key" if check.bucket_id[0] == "key" else f"the {tier_name} tier"
        unit = check.bucket_id[2]
        if math.isinf(retry_after_s):
            message = (
                f"Request too large: it needs {check.need} tokens (prompt + max_tokens) but {scope} "
                f"allows {check.capacity} tokens per minute. Reduce the prompt or max_tokens."
            )
            return RateLimited(Reason.REQUEST_TOO_LARGE, message, retry_after_s=_PERIOD_S, buckets=views)
        message = (
            f"Rate limit reached for {unit} per minute on {scope}: limit {check.capacity}, "
            f"requested {check.need}. Please try again in {format_reset(retry_after_s)}."
        )
        log.debug("rate_limited", reason=check.reason.value, tier=tier_name, retry_after_s=retry_after_s)
        return RateLimited(check.reason, message, retry_after_s=retry_after_s, buckets=views)

    def _views(self, key: str, tier_name: str, limits: Limits) -> tuple[BucketView, ...]:
        views = []
        for unit, pairs in (
            (
                "requests",
                ((key, "key", limits.requests_per_minute), (tier_name, "tier", limits.tier_requests_per_minute)),
            ),
            ("tokens", ((key, "key", limits.tokens_per_minute), (tier_name, "tier", limits.tier_tokens_per_minute))),
        ):
            peeks = [self._peek((scope, name, unit), capacity) for name, scope, capacity in pairs if capacity > 0]
            if peeks:  # unlimited: OpenAI sends no header for a dimension without a limit
                capacity, remaining, reset_s = min(peeks, key=lambda v: v[1])
                views.append(BucketView(unit, capacity, remaining, reset_s))
        return tuple(views)

    def _peek(self, bucket_id: BucketId, capacity: int) -> tuple[int, float, float]:
        """(capacity, remaining, reset_s) without creating a bucket."""
        bucket = self._buckets.get(bucket_id)
        if bucket is None or bucket.capacity != capacity:
            used = 0.0 if bucket is None else bucket.capacity - bucket.level
            return capacity, capacity - used, used / (capacity / _PERIOD_S)
        return capacity, bucket.level, bucket.reset_s()


def _checks_for(key: str, tier_name: str, limits: Limits, num_tokens_reserved: int) -> tuple[_Check, ...]:
    candidates = (
        _Check(Reason.KEY_REQUESTS, ("key", key, "requests"), limits.requests_per_minute, 1),
        _Check(Reason.KEY_TOKENS, ("key", key, "tokens"), limits.tokens_per_minute, num_tokens_reserved),
        _Check(Reason.TIER_REQUESTS, ("tier", tier_name, "requests"), limits.tier_requests_per_minute, 1),
        _Check(Reason.TIER_TOKENS, ("tier", tier_name, "tokens"), limits.tier_tokens_per_minute, num_tokens_reserved),
    )
    return tuple(c for c in candidates if c.capacity > 0)


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI writes reset headers: "12ms", "1s", "1.5s", "6m0s", "1h0m0s"."""
    total_ms = math.ceil(round(seconds * 1000, 6))  # round first: 0.1 * 1000 is 100.00000000000001
    if total_ms <= 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    secs = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs
