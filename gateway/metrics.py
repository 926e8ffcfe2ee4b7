"""Prometheus metrics for GET /metrics, on a registry of its own (one per app, so tests can
build many apps). Request-path code calls the small `observe_*` / `count_*` methods; engine
and queue gauges are read from registered sources at scrape time, never pushed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.types import EngineStats, FinishReason

if TYPE_CHECKING:
    from store.types import RequestRecord

log = structlog.get_logger(__name__)

# Latency buckets in seconds (vLLM's choices, trimmed): TTFT and end-to-end span ms to minutes.
_TTFT_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class WaitingQueue(Protocol):
    """What the scrape reads from a gateway queue (gateway.queue.ModelQueue fits)."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_reserved(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _Sources:
    stats: Callable[[], EngineStats]
    queue: WaitingQueue | None = None  # the gateway queue in front of the engine


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, tm = self.registry, ("tier", "model")
        self._ttft = Histogram(
            "chat_time_to_first_token_seconds", "Arrival to first token.", tm, buckets=_TTFT_BUCKETS_S, registry=r
        )
        self._itl = Histogram(
            "chat_inter_token_latency_seconds", "Between streamed token events.", tm, buckets=_ITL_BUCKETS_S, registry=r
        )
        self._queue = Histogram(
            "chat_queue_time_seconds", "Time waiting in the gateway queue.", tm, buckets=_TTFT_BUCKETS_S, registry=r
        )
        self._e2e = Histogram(
            "chat_e2e_request_latency_seconds", "Arrival to last token.", tm, buckets=_E2E_BUCKETS_S, registry=r
        )
        self._prompt_tokens = Counter("chat_prompt_tokens", "Prompt tokens of finished requests.", tm, registry=r)
        self._cached_tokens = Counter(
            "chat_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", tm, registry=r
        )
        self._generation_tokens = Counter("chat_generation_tokens", "Completion tokens generated.", tm, registry=r)
        self._reasoning_tokens = Counter(
            "chat_reasoning_tokens", "Of the completion tokens, those a reasoning model spent thinking.", tm, registry=r
        )
        self._finished = Counter(
            "chat_requests_finished", "Finished requests by finish reason.", (*tm, "finish_reason"), registry=r
        )
        self._rejections = Counter(
            "chat_rejections", "Requests refused: caller's limits or server load.", (*tm, "reason", "kind"), registry=r
        )
        self._over_lower = Counter(
            "chat_refused_over_lower_tier",
            "Load refusals while a lower tier held a queue place (it had aged past the refused request's tier).",
            tm,
            registry=r,
        )
        self._over_lower_priority = Counter(
            "chat_refused_over_lower_priority",
            "Load refusals while a request of lower effective (aged) priority held a queue place (only when "
            "the refused request's tokens would not fit in the places it could take).",
            tm,
            registry=r,
        )
        self._fallbacks = Counter(
            "chat_fallbacks",
            "Requests served by another model than asked.",
            ("tier", "from_model", "to_model"),
            registry=r,
        )
        self._sources: dict[str, _Sources] = {}
        self.registry.register(_SourceCollector(self._sources))

    def observe_request(self, record: RequestRecord, finish: FinishReason | None, reasoning_tokens: int = 0) -> None:
        """Everything about one finished, aborted or failed request, read from its ledger record
        (and how many of its completion tokens were thinking, which the ledger does not keep).

        The inter-token latency observed here is the request's mean (vLLM's TPOT).
        """
        tier, model = record.tier, record.model
        if reasoning_tokens:
            self._reasoning_tokens.labels(tier, model).inc(reasoning_tokens)
        for histogram, value_ms in (
            (self._queue, record.queue_ms),
            (self._ttft, record.ttft_ms),
            (self._e2e, record.total_ms),
        ):
            if value_ms is not None:
                histogram.labels(tier, model).observe(value_ms / 1000.0)
        if record.ttft_ms is not None and record.total_ms is not None and record.completion_tokens > 1:
            tpot_s = (record.total_ms - record.ttft_ms) / 1000.0 / (record.completion_tokens - 1)
            self._itl.labels(tier, model).observe(tpot_s)
        reason = finish.value if finish is not None else record.status.value
        self.count_finished(tier, model, reason, (record.prompt_tokens, record.cached_tokens, record.completion_tokens))
        if record.fallback_from is not None:
            self.count_fallback(tier, record.fallback_from, model)

    def count_finished(self, tier: str, model: str, finish_reason: str, usage: tuple[int, int, int]) -> None:
        """One finished (or aborted) request; usage is (prompt, cached, completion) tokens."""
        num_prompt, num_cached, num_completion = usage
        self._finished.labels(tier, model, finish_reason).inc()
        self._prompt_tokens.labels(tier, model).inc(num_prompt)
        self._cached_tokens.labels(tier, model).inc(num_cached)
        self._generation_tokens.labels(tier, model).inc(num_completion)

    def count_rejection(self, tier: str, model: str, reason: str, kind: str) -> None:
        """A refused request; `reason` is a gateway.errors.Reason value, `kind` limit or load."""
        self._rejections.labels(tier, model, reason, kind).inc()

    def count_refused_over_lower_tier(self, tier: str, model: str) -> None:
        self._over_lower.labels(tier, model).inc()

    def count_refused_over_lower_priority(self, tier: str, model: str) -> None:
        self._over_lower_priority.labels(tier, model).inc()

    def count_fallback(self, tier: str, from_model: str, to_model: str) -> None:
        self._fallbacks.labels(tier, from_model, to_model).inc()

    def set_stats_source(self, model: str, stats: Callable[[], EngineStats], queue: WaitingQueue | None = None) -> None:
        """Read at every scrape: running/waiting requests, KV usage, prefix cache, preemptions.

        With `queue`, the waiting gauge adds the requests waiting in the gateway queue.
        """
        self._sources[model] = _Sources(stats, queue)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for the /metrics handler."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _SourceCollector(Collector):
    """Gauges filled at scrape time; a failing source is skipped, never fails the scrape."""

    def __init__(self, sources: dict[str, _Sources]):
        self._sources = sources

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic: nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        gauges = {
            "running": GaugeMetricFamily("chat_requests_running", "Requests running in the engine.", labels=["model"]),
            "waiting": GaugeMetricFamily(
                "chat_requests_waiting", "Requests waiting (gateway queue + engine).", labels=["model"]
            ),
            "kv": GaugeMetricFamily("chat_kv_cache_usage_ratio", "Share of KV-cache blocks in use.", labels=["model"]),
            "engine_waiting": GaugeMetricFamily(
                "chat_engine_requests_waiting", "Requests the engine holds but has not started.", labels=["model"]
            ),
            "reserved": GaugeMetricFamily(
                "chat_requests_reserved", "Engine reservations held (admitted, not yet finished).", labels=["model"]
            ),
            "hit_rate": GaugeMetricFamily(
                "chat_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.", labels=["model"]
            ),
        }
        preemptions = CounterMetricFamily("chat_preemptions", "Sequences preempted by the engine.", labels=["model"])
        drafts = CounterMetricFamily(
            "chat_spec_draft_tokens", "Draft tokens fed by speculation (engine.speculative_tokens).", labels=["model"]
        )
        accepted = CounterMetricFamily(
            "chat_spec_accepted_tokens", "Draft tokens speculation kept (the model agreed).", labels=["model"]
        )
        for model, sources in list(self._sources.items()):
            num_waiting = sources.queue.num_waiting if sources.queue is not None else 0
            if sources.queue is not None:
                gauges["reserved"].add_metric([model], sources.queue.num_reserved)
            stats = _read(model, sources.stats)
            if stats is not None:
                gauges["running"].add_metric([model], stats.num_running)
                gauges["kv"].add_metric([model], stats.kv_usage)
                queries = stats.prefix_cache_queries
                gauges["hit_rate"].add_metric([model], stats.prefix_cache_hits / queries if queries else 0.0)
                preemptions.add_metric([model], stats.num_preemptions)
                drafts.add_metric([model], stats.num_draft_tokens)
                accepted.add_metric([model], stats.num_accepted_draft_tokens)
                num_waiting += stats.num_waiting
                gauges["engine_waiting"].add_metric([model], stats.num_waiting)
            gauges["waiting"].add_metric([model], num_waiting)
        yield from gauges.values()
        yield preemptions
        yield drafts
        yield accepted


def _read(model: str, source: Callable[[], EngineStats]) -> EngineStats | None:
    try:
        return source()
    except Exception:  # a dead backend must not take /metrics down with it
        log.warning("metrics_source_failed", model=model, exc_info=True)
        return None
