"""Admission: the one path from a caller's limits to a reservation in a model's engine.

Cheap refusals come first (`check`: the request and token buckets, debited with an estimate
from the body's size, the key's concurrent-stream cap, and a load refusal when no model of the
tier has a place), before anyone reads the body, parses, reads the store, tokenizes or
screens; `route` and `place` follow once the request is sized. A `Pass`
owns what one request holds (bucket debit, stream slot, queue ticket) and `close()` releases
each exactly once. A load refusal starts the key's retry age (`gateway.retry_age`): its
retries rank as if they had waited since, until the key gets a reservation. Plain values in,
`gateway.errors` out: no HTTP here. Chat completions and any other endpoint that generates
(the Responses API) call this same object.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from engine.types import Backend
from gateway.errors import GatewayError, Overloaded, Reason
from gateway.metrics import Metrics
from gateway.queue import ModelQueue, QueueTicket
from gateway.ratelimit import RateLimiter, Reservation, StreamTicket
from gateway.retry_age import RetryAges
from gateway.router import Route, TierRouter
from gateway.waiting_room import Offer
from settings import Settings, TierConfig

BYTES_PER_TOKEN = 4  # a prompt's size in tokens, estimated from its UTF-8 JSON bytes
AGING_REASONS = frozenset({Reason.QUEUE_FULL, Reason.WAIT_TOO_LONG, Reason.DISPLACED})  # refusals that age


@dataclass(frozen=True, slots=True)
class Caller:
    key: str  # the limiter's key: the API key id, or "org:<id>" without a key
    tier_name: str
    tier: TierConfig
    overrides: Mapping[str, float] | None = None  # the organisation's per-key limits
    waits_for_stream: bool = False  # keyless local use: over the stream cap, wait instead of 429


def estimate_tokens(num_body_bytes: int, max_context_tokens: int) -> int:
    """The prompt's size guessed from the body before it is parsed, at most what one request may
    use (prompt + max_tokens fit the tier's context): an image inline as a data: URL is megabytes
    of body but a few hundred tokens, and was refused as millions of tokens."""
    return max(1, min(num_body_bytes // BYTES_PER_TOKEN, max_context_tokens))


class Pass:
    """Everything one request holds from `check` to its end; a context manager releases it."""

    def __init__(
        self,
        admission: Admission,
        caller: Caller,
        request_id: str,
        reservation: Reservation,
        stream: StreamTicket | None,
        waiting_since_s: float | None = None,
    ):
        self._admission = admission
        self.caller = caller
        self.request_id = request_id
        self.reservation = reservation
        self.stream = stream
        self.route: Route | None = None
        self.ticket: QueueTicket | None = None
        self.num_tokens_used = 0  # prompt + completion tokens actually processed (set by the handler)
        self.waiting_since_s = waiting_since_s  # the arrival its key's retry age carries; None: fresh
        self.is_closed = False
        self._is_admission_noted = False

    @property
    def is_admitted(self) -> bool:
        return self.ticket is not None and self.ticket.admitted_s is not None

    async def wait(self, timeout_s: float | None = None) -> bool:
        """True once the request holds an engine reservation; raises Overloaded if displaced."""
        assert self.ticket is not None, "place() first"
        try:
            is_admitted = await self.ticket.wait(timeout_s)
        except Overloaded as exc:
            if exc.reason is Reason.DISPLACED:  # not SHUTTING_DOWN: the queue stopped
                self._admission.count_displaced(self)
            raise
        if is_admitted:
            self.note_admitted()
        return is_admitted

    def note_admitted(self) -> None:
        """The key got a reservation: its retry age ends (once, so a later refusal's stays)."""
        if not self._is_admission_noted:
            self._is_admission_noted = True
            self._admission.retry_ages.admitted(self.caller.key)

    def close(self, *, refund: bool = False) -> None:
        """Release the queue ticket, stream slot and bucket debit, once.

        `refund`: the server refused the request (its load): give back every unit, the request
        included. Otherwise the tokens are settled on `num_tokens_used` and the request counts
        (a request refused for the caller's own reasons, a model not found included).
        """
        if self.is_closed:
            return
        self.is_closed = True
        if self.ticket is not None:
            self.ticket.release()
        if self.stream is not None:
            self.stream.release()
        limiter = self._admission.limiter
        if refund:
            limiter.cancel(self.reservation)
        else:
            limiter.settle(self.reservation, self.num_tokens_used)

    def __enter__(self) -> Pass:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(refund=isinstance(exc, Overloaded))


class Admission:
    def __init__(
        self,
        limiter: RateLimiter,
        router: TierRouter,
        queues: Mapping[str, ModelQueue],
        metrics: Metrics | None = None,
        retry_ages: RetryAges | None = None,
    ):
        """`retry_ages` must read the queues' clock; None: no aging across refusals."""
        self.limiter = limiter
        self.router = router
        self.queues = queues
        self.retry_ages = RetryAges(0.0, time.monotonic) if retry_ages is None else retry_ages
        self._metrics = metrics

    def check(self, caller: Caller, request_id: str, num_body_bytes: int) -> Pass:
        """The cheap refusals: buckets (size from the body's bytes), the stream cap, then load.

        Raises RateLimited, or Overloaded when no model of the caller's tier would take a
        request now (whatever model the body names), having kept nothing.
        """
        stream = None
        try:
            if not caller.waits_for_stream:
                stream = self.limiter.open_stream(caller.key, caller.tier.max_concurrent_streams)
            reservation = self.limiter.acquire(
                caller.key,
                caller.tier_name,
                caller.tier,
                estimate_tokens(num_body_bytes, caller.tier.max_context_tokens),
                caller.overrides,
            )
        except GatewayError as exc:
            if stream is not None:
                stream.release()
            self._note_refusal(caller, "-", exc)
            raise
        since_s = self.retry_ages.waiting_since(caller.key)
        grant = Pass(self, caller, request_id, reservation, stream, since_s)
        try:
            self.router.precheck(caller.tier_name, arrival_s=since_s)
        except Overloaded as exc:
            grant.close(refund=True)
            self._note_refusal(caller, caller.tier.models[0] if caller.tier.models else "-", exc)
            raise
        return grant

    def route(self, grant: Pass, requested_model: str | None, *, over_budget: bool = False) -> Route:
        """Which model serves; raises NotFound, OverQuota or Overloaded (every candidate full)."""
        try:
            grant.route = self.router.route(
                grant.caller.tier_name, requested_model, over_budget=over_budget, arrival_s=grant.waiting_since_s
            )
        except GatewayError as exc:
            self._note_refusal(grant.caller, requested_model or "auto", exc)
            raise
        return grant.route

    def place(self, grant: Pass, num_tokens_reserved: int, *, num_seqs: int = 1) -> QueueTicket:
        """Debit the real size (prompt + max_tokens), then reserve or queue on the routed model;
        `num_seqs` engine sequences (n choices) are reserved together.

        Raises RateLimited or Overloaded; a queued ticket may later fail with DISPLACED.
        """
        assert grant.route is not None, "route() first"
        caller, model = grant.caller, grant.route.model
        offer = Offer(
            grant.request_id,
            caller.tier.priority,
            num_tokens_reserved,
            caller.key,
            caller.tier.max_concurrent_streams if caller.waits_for_stream else 0,
            self.router.wait_limit_s(caller.tier_name, model),
            num_seqs,
            grant.waiting_since_s,
        )
        try:
            self.limiter.top_up(grant.reservation, num_tokens_reserved)
            grant.ticket = self.queues[model].enqueue(offer)
        except GatewayError as exc:
            self._note_refusal(caller, model, exc)
            raise
        if grant.ticket.admitted_s is not None:
            grant.note_admitted()
        return grant.ticket

    def count_displaced(self, grant: Pass) -> None:
        """A queued request lost its place: its key ages on from when it joined the line."""
        assert grant.ticket is not None
        since_s = grant.ticket.arrival_s if grant.waiting_since_s is None else grant.waiting_since_s
        self.retry_ages.refused(grant.caller.key, since_s)
        if grant.route is not None and self._metrics is not None:
            self._metrics.count_rejection(grant.caller.tier_name, grant.route.model, Reason.DISPLACED.value, "load")

    def _note_refusal(self, caller: Caller, model: str, exc: GatewayError) -> None:
        """Counters and the key's retry age only: a refusal storm must not cost a log line
        each (a filtered structlog call still binds a logger, about 0.4 ms here)."""
        if exc.reason in AGING_REASONS:
            self.retry_ages.refused(caller.key)
        if self._metrics is None:
            return
        kind = "load" if isinstance(exc, Overloaded) else "limit"
        # A label is kept for the life of the process: only configured names, never the caller's text.
        label = model if model in self.queues or model in ("-", "auto") else "unknown"
        self._metrics.count_rejection(caller.tier_name, label, exc.reason.value, kind)
        if isinstance(exc, Overloaded) and exc.num_outranked_waiting:
            self._metrics.count_refused_over_lower_tier(caller.tier_name, model)
        if isinstance(exc, Overloaded) and exc.num_below_waiting:
            self._metrics.count_refused_over_lower_priority(caller.tier_name, model)


def _always() -> bool:
    return True


def build_admission(settings: Settings, backends: Mapping[str, Backend], metrics: Metrics) -> Admission:
    """One queue per model (as many reservations as its backend runs at once), the router
    over them and a fresh limiter; the queues feed the metrics' gauges."""
    queues = {
        name: ModelQueue(
            name,
            settings.queue,
            has_room=backend.has_room,
            capacity=backend.max_num_running,
            # optional: only backends that can lose their server (engine/upstream) have it
            is_available=getattr(backend, "is_available", _always),
        )
        for name, backend in backends.items()
    }
    for name, backend in backends.items():
        metrics.set_stats_source(name, backend.stats, queues[name])
    router = TierRouter(settings.models, settings.tiers, queues)
    retry_ages = RetryAges(settings.queue.aging_s, time.monotonic) if settings.queue.age_retries else None
    return Admission(RateLimiter(), router, queues, metrics, retry_ages)  # ages on the queues' clock
