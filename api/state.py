"""The application's typed state and the policy seams the chat handler calls.

`AppState` holds the long-lived parts (settings, models, store, limiter, queues, router,
safety gate, metrics) and offers the few operations the request path needs, so handlers do
not reach into gateway internals. `Admission` is the single owner of a request's
bucket reservation, stream slot and queue ticket.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from api.errors import ApiError, overloaded
from api.turn import Turn
from engine.registry import ModelHandle
from engine.types import FinishReason, TokenEvent
from gateway.coalesce import Coalescer
from gateway.metrics import Metrics
from gateway.queue import ModelQueue, QueueError
from gateway.ratelimit import RateLimited, RateLimiter
from gateway.router import TierRouter
from settings import Settings, TierConfig
from store.store import Store
from store.types import Principal, RequestRecord, StoreUnavailable

log = structlog.get_logger(__name__)

PRINCIPAL = web.RequestKey("principal", Principal)  # set by the auth middleware
REQUEST_ID = web.RequestKey("request_id", str)  # set by the request-id middleware


@dataclass(slots=True)
class AppState:
    settings: Settings
    models: dict[str, ModelHandle]
    store: Store
    limiter: RateLimiter
    queues: dict[str, ModelQueue]
    router: TierRouter
    metrics: Metrics
    coalescer: Coalescer = field(default_factory=Coalescer)
    safety: object | None = None  # gateway.safety.SafetyGate when enabled
    local_principal: Principal | None = None
    draining: bool = False
    num_active: int = 0

    # -- identity and policy ---------------------------------------------------------
    def tier_of(self, principal: Principal) -> tuple[str, TierConfig]:
        name = principal.org.tier
        tier = self.settings.tiers.get(name)
        if tier is None:
            raise ApiError(403, f"The organisation's tier '{name}' is not configured on this server.",
                           "permission_error", "tier_not_configured")
        return name, tier

    async def over_budget(self, principal: Principal) -> bool:
        budget = principal.org.budget_usd
        if budget is None:
            return False
        return await self.store.month_spend_usd(principal.org.id) >= budget

    def cache_salt(self, principal: Principal) -> str | None:
        return principal.org.id if self.settings.engine.prefix_cache_scope == "org" else None

    def limiter_key(self, principal: Principal) -> str:
        return principal.key_id or f"org:{principal.org.id}"

    def cost_usd(self, turn: Turn) -> float:
        cfg = turn.model.config
        uncached = turn.num_prompt_tokens - turn.num_cached_tokens
        return (
            uncached * cfg.price_input_per_mtok
            + turn.num_cached_tokens * cfg.price_cached_input_per_mtok
            + turn.num_completion_tokens * cfg.price_output_per_mtok
        ) / 1e6

    def response_headers(self, turn: Turn) -> dict[str, str]:
        key = self.limiter_key(turn.principal)
        headers = self.limiter.headers(key, turn.tier_name, turn.tier, turn.principal.org.limits)
        if turn.fallback_from is not None:
            headers["x-fallback-from"] = turn.fallback_from
        if turn.chat.conversation_id is not None:
            headers["x-history-turns-dropped"] = str(turn.history_turns_dropped)
        return headers

    def admission(self, turn: Turn) -> "Admission":
        return Admission(self, turn)

    # -- safety ------------------------------------------------------------------------
    async def screen_prompt(self, turn: Turn):
        """None when allowed; the blocking verdict otherwise."""
        if self.safety is None:
            return None
        messages = [{"role": m.role, "content": m.content} for m in turn.context]
        verdict = await self.safety.screen_prompt(messages, tier=turn.tier_name)
        return None if verdict.allowed else verdict

    def output_filter(self, turn: Turn):
        return None if self.safety is None else self.safety.output_filter(tier=turn.tier_name)

    def count_filtered(self, turn: Turn, verdict) -> None:
        log.info("output_filtered", request_id=turn.request_id, layer=verdict.layer, category=verdict.category)

    # -- generation and billing ----------------------------------------------------------
    def generate(self, turn: Turn) -> AsyncIterator[TokenEvent]:
        return self.coalescer.generate(turn.model.backend, turn.gen)

    async def record(self, turn: Turn, record: RequestRecord, finish: FinishReason | None) -> None:
        """Write the ledger row + messages (shielded from cancellation), then log and count."""
        try:
            await asyncio.shield(self.store.record_request(record))
        except StoreUnavailable as exc:
            log.error("ledger_write_failed", request_id=record.request_id, error=str(exc))
        self.metrics.observe_request(turn, record, finish)
        log.info(
            "request_finished",
            request_id=record.request_id,
            tier=record.tier,
            model=record.model,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens,
            queue_ms=record.queue_ms,
            ttft_ms=record.ttft_ms,
            total_ms=record.total_ms,
            finish_reason=None if finish is None else finish.value,
            status=record.status.value,
        )


class Admission:
    """Bucket reservation + stream slot + queue ticket of one request, released once."""

    def __init__(self, state: AppState, turn: Turn):
        self._state = state
        self._turn = turn
        self._stream = None
        self._reservation = None
        self._ticket = None

    async def __aenter__(self) -> "Admission":
        state, turn = self._state, self._turn
        key = state.limiter_key(turn.principal)
        try:
            self._stream = state.limiter.open_stream(key, turn.tier.max_concurrent_streams)
            self._reservation = state.limiter.acquire(
                key, turn.tier_name, turn.tier, turn.est_tokens, turn.principal.org.limits
            )
            if not state.store.is_writable:
                raise overloaded("The usage ledger cannot be written; try again later.", retry_after_s=30,
                                 code="store_unavailable")
            self._ticket = state.queues[turn.model.name].enqueue(turn.request_id, turn.tier.priority, turn.est_tokens)
        except RateLimited as exc:
            self._release(admitted=False)
            state.metrics.count_rejection(turn.tier_name, turn.model.name, exc.reason.value, 429)
            raise exc.to_api_error() from None
        except QueueError as exc:
            self._release(admitted=False)
            state.metrics.count_rejection(turn.tier_name, turn.model.name, exc.code, 503)
            raise exc.to_api_error() from None
        except BaseException:
            self._release(admitted=False)
            raise
        state.num_active += 1
        return self

    async def wait(self, on_wait: Callable[[int], Awaitable[None]] | None) -> None:
        """Wait for the queue to admit this request; `on_wait(position)` every heartbeat."""
        interval = self._state.settings.server.heartbeat_s
        while not await self._ticket.wait(interval):
            if on_wait is not None:
                await on_wait(self._ticket.position)
        self._turn.admitted_s = time.monotonic()

    async def __aexit__(self, *exc_info) -> None:
        self._state.num_active -= 1
        self._release(admitted=self._turn.admitted_s is not None)

    def _release(self, *, admitted: bool) -> None:
        limiter = self._state.limiter
        if self._ticket is not None:
            self._ticket.cancel()
            self._state.queues[self._turn.model.name].notify()
        if self._reservation is not None:
            if admitted:
                limiter.settle(self._reservation, self._turn.num_prompt_tokens + self._turn.num_completion_tokens)
            else:
                limiter.cancel(self._reservation)
        if self._stream is not None:
            self._stream.release()


STATE = web.AppKey("state", AppState)
SETTINGS = web.AppKey("settings", Settings)
