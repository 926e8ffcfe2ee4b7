"""Per-replica metrics of upstream models for GET /metrics: requests in flight, requests sent,
errors by kind, breaker state and time to first token, read from the replicas at scrape time.

One collector serves every upstream model of an app (so each metric family appears once).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.upstream.breaker import BREAKER_GAUGE, FailureKind

if TYPE_CHECKING:
    from engine.upstream.backend import UpstreamBackend

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class LatencyHistogram:
    """Bucket counts of one replica's latencies (cumulative at render time)."""

    __slots__ = ("counts", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(TTFT_BUCKETS_S) + 1)  # the last one is +Inf
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(TTFT_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, count in zip((*map(str, TTFT_BUCKETS_S), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class UpstreamCollector(Collector):
    def __init__(self, backends: Mapping[str, UpstreamBackend]):
        self._backends = dict(backends)  # model name -> its backend

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        labels = ["model", "replica"]
        in_flight = GaugeMetricFamily(
            "chat_upstream_requests_in_flight", "Requests in flight on an upstream replica.", labels=labels
        )
        breaker = GaugeMetricFamily(
            "chat_upstream_breaker_state",
            "Circuit breaker of an upstream replica: 0 closed, 1 half-open, 2 open.",
            labels=labels,
        )
        sent = CounterMetricFamily("chat_upstream_requests", "Requests sent to an upstream replica.", labels=labels)
        errors = CounterMetricFamily(
            "chat_upstream_errors", "Failed upstream requests by kind.", labels=[*labels, "kind"]
        )
        ttft = HistogramMetricFamily(
            "chat_upstream_time_to_first_token_seconds",
            "Request sent to first content chunk, per upstream replica.",
            labels=labels,
        )
        for model, backend in self._backends.items():
            for r in backend.pool.replicas:
                key = [model, r.label]
                in_flight.add_metric(key, r.num_in_flight)
                breaker.add_metric(key, BREAKER_GAUGE[r.breaker.state])
                sent.add_metric(key, r.num_requests)
                for kind in FailureKind:
                    errors.add_metric([*key, kind.value], r.num_errors[kind])
                ttft.add_metric(key, r.ttft.cumulative(), r.ttft.sum_s)
        yield from (in_flight, breaker, sent, errors, ttft)


def register_upstream_metrics(registry: CollectorRegistry, backends: Mapping[str, object]) -> None:
    """Export the replicas of every upstream backend among `backends` (others are skipped)."""
    from engine.upstream.backend import UpstreamBackend

    upstream = {name: b for name, b in backends.items() if isinstance(b, UpstreamBackend)}
    if upstream:
        registry.register(UpstreamCollector(upstream))
