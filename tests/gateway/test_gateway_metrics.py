"""The Prometheus metrics: one registry per instance, request metrics, scrape-time engine gauges."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.types import EngineStats, FinishReason
from gateway.metrics import Metrics
from store.types import RequestRecord, RequestStatus


class WaitingQueue:
    def __init__(self, num_waiting: int, num_reserved: int = 0):
        self.num_waiting = num_waiting
        self.num_reserved = num_reserved


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_two_instances_do_not_share_a_registry():
    first, second = Metrics(), Metrics()
    first.count_rejection("free", "mini", "key_requests", "limit")
    labels = (("kind", "limit"), ("model", "mini"), ("reason", "key_requests"), ("tier", "free"))
    assert samples(first)[("chat_rejections_total", labels)] == 1
    assert not any(name == "chat_rejections_total" for name, _ in samples(second))


def test_finished_requests_and_tokens_are_counted_per_tier_and_model():
    metrics = Metrics()
    metrics.count_finished("plus", "flagship", "stop", (100, 40, 7))
    got = samples(metrics)
    labels = (("model", "flagship"), ("tier", "plus"))
    assert got[("chat_prompt_tokens_total", labels)] == 100
    assert got[("chat_cached_prompt_tokens_total", labels)] == 40
    assert got[("chat_generation_tokens_total", labels)] == 7
    assert got[("chat_requests_finished_total", (("finish_reason", "stop"), *labels))] == 1


def test_fallbacks_are_counted_with_their_labels():
    metrics = Metrics()
    metrics.count_fallback("plus", "flagship", "mini")
    got = samples(metrics)
    assert got[("chat_fallbacks_total", (("from_model", "flagship"), ("tier", "plus"), ("to_model", "mini")))] == 1
    assert not any(name.startswith("chat_safety_decisions") for name, _ in got)  # one safety metric: the gate's


def test_engine_gauges_are_read_from_the_stats_source_at_scrape_time():
    metrics = Metrics()
    stats = {
        "value": EngineStats(
            num_running=3,
            num_waiting=1,
            num_kv_blocks_total=100,
            num_kv_blocks_free=25,
            prefix_cache_queries=200,
            prefix_cache_hits=50,
            num_preemptions=4,
            num_draft_tokens=40,
            num_accepted_draft_tokens=30,
        )
    }
    metrics.set_stats_source("mini", lambda: stats["value"], WaitingQueue(5, num_reserved=3))
    got = samples(metrics)
    model = (("model", "mini"),)
    assert got[("chat_requests_running", model)] == 3
    assert got[("chat_requests_reserved", model)] == 3
    assert got[("chat_requests_waiting", model)] == 6  # 5 in the gateway queue + 1 in the engine
    assert got[("chat_kv_cache_usage_ratio", model)] == 0.75
    assert got[("chat_prefix_cache_hit_rate", model)] == 0.25
    assert got[("chat_preemptions_total", model)] == 4
    assert got[("chat_spec_draft_tokens_total", model)] == 40
    assert got[("chat_spec_accepted_tokens_total", model)] == 30
    stats["value"] = EngineStats(num_running=0)
    assert samples(metrics)[("chat_requests_running", model)] == 0


def test_a_failing_stats_source_does_not_break_the_scrape():
    metrics = Metrics()

    def broken() -> EngineStats:
        raise RuntimeError("engine gone")

    metrics.set_stats_source("mini", broken, WaitingQueue(2))
    metrics.set_stats_source("flagship", lambda: EngineStats(num_running=1))
    got = samples(metrics)
    assert got[("chat_requests_waiting", (("model", "mini"),))] == 2
    assert ("chat_requests_running", (("model", "mini"),)) not in got
    assert got[("chat_requests_running", (("model", "flagship"),))] == 1


def record(**changes) -> RequestRecord:
    fields = dict(
        request_id="req_1",
        org_id="org_1",
        key_id="key_1",
        model="mini",
        tier="plus",
        status=RequestStatus.FINISHED,
        prompt_tokens=50,
        cached_tokens=16,
        completion_tokens=11,
        cost_usd=0.0,
        queue_ms=100.0,
        ttft_ms=300.0,
        total_ms=1300.0,
        created_at=0.0,
        finished_at=1.3,
    )
    return RequestRecord(**{**fields, **changes})


def test_observe_request_records_latencies_tokens_and_fallback_from_the_ledger_record():
    metrics = Metrics()
    metrics.observe_request(record(fallback_from="flagship"), FinishReason.STOP)
    metrics.observe_request(record(status=RequestStatus.ERROR, queue_ms=None, ttft_ms=None, completion_tokens=0), None)
    got = samples(metrics)
    labels = (("model", "mini"), ("tier", "plus"))
    assert got[("chat_queue_time_seconds_count", labels)] == 1
    assert got[("chat_time_to_first_token_seconds_sum", labels)] == 0.3
    assert got[("chat_e2e_request_latency_seconds_count", labels)] == 2
    assert got[("chat_inter_token_latency_seconds_sum", labels)] == 0.1  # (1.3 - 0.3) s / 10 gaps
    assert got[("chat_prompt_tokens_total", labels)] == 100
    assert got[("chat_generation_tokens_total", labels)] == 11
    assert got[("chat_requests_finished_total", (("finish_reason", "stop"), *labels))] == 1
    assert got[("chat_requests_finished_total", (("finish_reason", "error"), *labels))] == 1
    assert got[("chat_fallbacks_total", (("from_model", "flagship"), ("tier", "plus"), ("to_model", "mini")))] == 1
