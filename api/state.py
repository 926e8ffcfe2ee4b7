"""The application's typed state: the long-lived parts and the few lookups handlers share.

`AppState` holds settings, models, store, the gateway's `Admission` (limits, router,
queues), safety gate and metrics. Policy lives in `gateway/`; this module only turns a
principal into the plain values the gateway takes (`caller`) and renders its answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from api.errors import ApiError, ratelimit_headers
from api.job import Job
from api.turn_lock import TurnLocks
from engine.registry import ModelHandle
from engine.types import FinishReason, TokenEvent
from gateway.admission import Admission, Caller
from gateway.coalesce import Coalescer
from gateway.metrics import Metrics
from settings import Settings, TierConfig
from store import money
from store.store import Store
from store.types import Principal, RequestRecord, StoreUnavailable

if TYPE_CHECKING:
    from api.embeddings import EmbeddingsService
    from api.telemetry import Tracing
    from gateway.safety import SafetyGate

log = structlog.get_logger(__name__)
STORAGE_READ_S = 10.0  # how stale an organisation's conversation size may be when checked against its cap

PRINCIPAL = web.RequestKey("principal", Principal)  # set by the auth middleware
REQUEST_ID = web.RequestKey("request_id", str)  # set by the request-id middleware


@dataclass(slots=True)
class AppState:
    settings: Settings
    models: dict[str, ModelHandle]
    store: Store
    admission: Admission
    metrics: Metrics
    coalescer: Coalescer = field(default_factory=Coalescer)
    turn_locks: TurnLocks = field(default_factory=TurnLocks)  # one turn at a time per conversation
    safety: SafetyGate | None = None  # when enabled
    tracing: Tracing | None = None  # telemetry.otlp_traces_endpoint set
    embeddings: EmbeddingsService | None = None  # embeddings.enabled
    local_principal: Principal | None = None
    draining: bool = False
    # Per organisation with a budget: the most its answers in flight can still cost (prompt and
    # n x max_tokens at list prices), so that concurrent requests cannot all pass a budget that
    # only the first could stay within (api/chat.py reserves, and releases once billed).
    budget_in_flight_usd: dict[str, float] = field(default_factory=dict)
    # Per organisation: (its conversations' stored characters, loop time read), re-read at most
    # every STORAGE_READ_S: the cap is checked before each write without a scan each time.
    _conversation_bytes: dict[str, tuple[int, float]] = field(default_factory=dict)
    _local_read_s: float = -math.inf  # loop time local_principal's organisation was last read
    _local_reading: asyncio.Future[Principal] | None = None  # that read, while under way

    async def keyless_principal(self) -> Principal | None:
        """The keyless `local` organisation's principal, its tier, budget and limits re-read at
        most every store.key_cache_s (as keys' are), so `orgs set local` or the admin API
        reaches a running server. Requests arriving while it is read wait for that read: served
        on the old one, a burst right after a budget change passed the new budget several times."""
        local = self.local_principal
        if local is None:
            return None
        reading = self._local_reading
        if reading is None:
            now = asyncio.get_running_loop().time()
            if now - self._local_read_s < self.settings.store.key_cache_s:
                return local
            self._local_read_s = now
            reading = self._local_reading = asyncio.ensure_future(self._read_local_org(local))
            reading.add_done_callback(self._local_read_done)
        return await asyncio.shield(reading)  # one caller's disconnect does not cancel the others' read

    async def _read_local_org(self, local: Principal) -> Principal:
        org = await self.store.get_org(local.org.name)
        if org is not None and self.local_principal is local:  # not replaced meanwhile
            self.local_principal = local = Principal(None, org)
        return self.local_principal or local

    def _local_read_done(self, reading: asyncio.Future) -> None:
        if self._local_reading is reading:
            self._local_reading = None
        if not reading.cancelled() and reading.exception() is not None:
            self._local_read_s = -math.inf  # failed (the store was unavailable): the next request reads again

    def forget_local_org(self) -> None:
        """Re-read the local organisation on its next request (it was just changed here). A read
        already under way may predate the change: the next request starts its own."""
        self._local_read_s = -math.inf
        self._local_reading = None

    # -- identity and policy ---------------------------------------------------------
    def tier_of(self, principal: Principal) -> tuple[str, TierConfig]:
        name = principal.org.tier
        tier = self.settings.tiers.get(name)
        if tier is None:
            raise ApiError(
                403,
                f"The organisation's tier '{name}' is not configured on this server.",
                "permission_error",
                "tier_not_configured",
            )
        return name, tier

    async def over_budget(self, principal: Principal) -> bool:
        """This month's spend, and what the organisation's answers in flight may still cost, has
        reached its budget."""
        budget = principal.org.budget_usd
        if budget is None:
            return False
        in_flight = self.budget_in_flight_usd.get(principal.org.id, 0.0)
        return await self.store.month_spend_usd(principal.org.id) + in_flight >= budget

    async def check_conversation_storage(self, principal: Principal, adding: int = 0) -> None:
        """400 `conversation_quota_exceeded` when the organisation's conversations hold its tier's
        `conversation_storage_bytes` (or would, with `adding` more characters)."""
        _tier_name, tier = self.tier_of(principal)
        cap = tier.conversation_storage_bytes
        if cap == 0:
            return
        org_id, now = principal.org.id, asyncio.get_running_loop().time()
        entry = self._conversation_bytes.get(org_id)
        if entry is None or now - entry[1] > STORAGE_READ_S:
            read = await self.store.conversation_bytes(org_id)
            # Checks that passed while this one read counted what they add in an entry of their own,
            # maybe not yet written: the larger count stands (each passed against the same old size).
            latest = self._conversation_bytes.get(org_id)
            entry = (max(read, latest[0]) if latest is not None and latest is not entry else read, now)
        stored, read_s = entry
        if stored + adding > cap:
            raise ApiError(
                400,
                f"Conversation storage is full: your conversations (and share links) hold {stored:,} characters of "
                f"the {cap:,} your tier keeps{f', and this would add {adding:,}' if adding else ''}. Delete "
                "conversations or share links you no longer need.",
                "invalid_request_error",
                "conversation_quota_exceeded",
            )
        self._conversation_bytes[org_id] = (stored + adding, read_s)  # counted until the next read

    def forget_conversation_bytes(self, org_id: str) -> None:
        """After a delete or a truncation: the next check reads the size again."""
        self._conversation_bytes.pop(org_id, None)

    def max_cost_usd(self, job: Job) -> float:
        """The most `job` can cost: every prompt token uncached, every choice to max_tokens."""
        cfg = job.model.config
        output = job.chat.n * job.gen.sampling.max_tokens
        return float(
            money.cost_usd(((job.num_prompt_tokens, cfg.price_input_per_mtok), (output, cfg.price_output_per_mtok)))
        )

    async def month_spend_if_budgeted(self, principal: Principal) -> float | None:
        """This month's spend of an organisation with a budget; None without one."""
        if principal.org.budget_usd is None:
            return None
        return await self.store.month_spend_usd(principal.org.id)

    @contextlib.contextmanager
    def budget_reserved(self, job: Job, spend: float | None) -> Iterator[None]:
        """Hold the job's most possible cost against its organisation's budget until it is billed;
        429 `insufficient_quota` when answers already in flight hold the rest of it (each request
        may still cross the budget by its own cost, as the last one before it always could)."""
        org = job.principal.org
        if (
            org.budget_usd is None or spend is None or job.fallback_reason == "over_budget"
        ):  # the cheaper model serves it
            yield
            return
        in_flight = self.budget_in_flight_usd.get(org.id, 0.0)
        if spend >= org.budget_usd:  # billed since the request's first check (its preparation can take seconds)
            raise ApiError(
                429,
                "You exceeded your current budget; check your plan and billing details.",
                "insufficient_quota",
                "insufficient_quota",
            )
        if in_flight > 0 and spend + in_flight >= org.budget_usd:
            raise ApiError(
                429,
                "The rest of your budget is held by answers still running; retry when they finish.",
                "insufficient_quota",
                "insufficient_quota",
                headers={"Retry-After": "5"},
            )
        cost = self.max_cost_usd(job)
        self.budget_in_flight_usd[org.id] = self.budget_in_flight_usd.get(org.id, 0.0) + cost
        try:
            yield
        finally:  # the one release path: the ledger row (written before this) now holds the real cost
            left = self.budget_in_flight_usd.get(org.id, 0.0) - cost
            if left > 1e-12:
                self.budget_in_flight_usd[org.id] = left
            else:
                self.budget_in_flight_usd.pop(org.id, None)

    def cache_salt(self, principal: Principal) -> str | None:
        return principal.org.id if self.settings.engine.prefix_cache_scope == "org" else None

    def caller(self, principal: Principal) -> Caller:
        """The plain values admission takes. Keyless local use (one person) waits for a
        stream when over the tier's concurrent-stream cap instead of getting 429."""
        tier_name, tier = self.tier_of(principal)
        is_local = self.local_principal is not None and principal.org.id == self.local_principal.org.id
        key = principal.key_id or f"org:{principal.org.id}"
        return Caller(
            key, tier_name, tier, principal.org.limits, waits_for_stream=is_local and principal.key_id is None
        )

    def charge_request(self, principal: Principal) -> Caller:
        """Count one request (no tokens) against the caller's request limits; RateLimited (429)
        when over them. For calls that write to the store outside the chat path, and those that
        generate nothing and are not billed (moderations). Returns the caller it charged."""
        caller = self.caller(principal)
        limiter = self.admission.limiter
        limiter.settle(limiter.acquire(caller.key, caller.tier_name, caller.tier, 0, caller.overrides), 0)
        return caller

    def cost_usd(self, job: Job) -> float:
        """Computed in decimal and rounded to the nano-dollar (store/money.py)."""
        cfg = job.model.config
        uncached = job.num_prompt_tokens - job.num_cached_tokens
        return float(
            money.cost_usd(
                (
                    (uncached, cfg.price_input_per_mtok),
                    (job.num_cached_tokens, cfg.price_cached_input_per_mtok),
                    (job.num_completion_tokens, cfg.price_output_per_mtok),
                )
            )
        )

    def limit_headers(self, caller: Caller) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the caller's buckets as they are now."""
        return ratelimit_headers(
            self.admission.limiter.buckets(caller.key, caller.tier_name, caller.tier, caller.overrides)
        )

    def response_headers(self, job: Job) -> dict[str, str]:
        headers = self.limit_headers(self.caller(job.principal))
        if job.fallback_from is not None:
            headers["x-fallback-from"] = job.fallback_from
            if job.fallback_reason is not None:
                headers["x-fallback-reason"] = job.fallback_reason
        if job.chat.conversation_id is not None:
            headers["x-history-messages-dropped"] = str(job.history_messages_dropped)
        return headers

    # -- safety ------------------------------------------------------------------------
    async def screen_prompt(self, job: Job):
        """None when allowed; the blocking verdict otherwise."""
        if self.safety is None:
            return None
        messages = [{"role": m.role, "content": m.content} for m in job.context]
        if job.chat.continue_final_message and messages:  # a prefill is the caller's text: screened as theirs
            messages[-1] = {"role": "user", "content": messages[-1]["content"]}
        verdict = await self.safety.screen_prompt(messages, tier=job.tier_name)
        return None if verdict.allowed else verdict

    def output_filter(self, job: Job):
        if self.safety is None:
            return None
        # An answer continuing a prefill is filtered with it: a phrase split across the two is seen.
        prefix = job.context[-1].content if job.chat.continue_final_message and job.context else ""
        return self.safety.output_filter(tier=job.tier_name, prefix=prefix)

    def count_filtered(self, job: Job, verdict) -> None:
        log.info("output_filtered", request_id=job.request_id, layer=verdict.layer, category=verdict.category)

    # -- generation and billing ----------------------------------------------------------
    def generate(self, job: Job, choice: int = 0) -> AsyncGenerator[TokenEvent, None]:
        return self.coalescer.generate(job.model.backend, job.gen_for(choice))

    async def record(self, job: Job | None, record: RequestRecord, finish: FinishReason | None) -> None:
        """Write the ledger row + messages (shielded from cancellation), then log, count and
        trace (job None: a request with no generation, such as embeddings; not traced).

        Raises StoreUnavailable when the write failed: the caller must not acknowledge the answer.
        """
        failure: StoreUnavailable | None = None
        try:
            await asyncio.shield(self.store.record_request(record))
        except StoreUnavailable as exc:
            log.error("ledger_write_failed", request_id=record.request_id, error=str(exc))
            failure = exc
        self.metrics.observe_request(record, finish, job.num_reasoning_tokens if job is not None else 0)
        if self.tracing is not None and job is not None:
            try:
                self.tracing.record(job, record, finish)
            except Exception:  # a tracing fault never fails a request
                log.exception("trace_record_failed", request_id=record.request_id)
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
        if failure is not None:
            raise failure


STATE = web.AppKey("state", AppState)
SETTINGS = web.AppKey("settings", Settings)
