"""bench/load.py's pure parts: loopback only, tier mix, percentiles, the per-tier summary."""

from __future__ import annotations

import pytest

from bench.load import Result, parse_mix, percentile, require_loopback, summarize


def test_the_load_tool_refuses_any_host_but_loopback():
    require_loopback("http://127.0.0.1:8000")
    require_loopback("http://localhost:8000")
    with pytest.raises(SystemExit):
        require_loopback("http://10.0.0.5:8000")


def test_the_mix_is_normalised_to_shares():
    assert parse_mix("free=2,plus=1,enterprise=1") == {"free": 0.5, "plus": 0.25, "enterprise": 0.25}


def test_percentiles_interpolate_between_ranks():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)


def test_the_summary_counts_outcomes_per_tier():
    results = [
        Result("free", "completed", 200, ttft_s=0.5, itls_s=[0.1, 0.2], latency_s=1.0),
        Result("free", "rejected", 429, code="rate_limit_exceeded", latency_s=0.004),
        Result("free", "rejected", 503, code="queue_full", latency_s=0.006),
        Result("plus", "completed", 200, ttft_s=0.1, fallback_from="flagship", latency_s=0.5),
        Result("plus", "timeout"),
    ]
    free, plus = summarize(results, ["free", "plus"])
    assert (free["sent"], free["admitted"], free["completed"], free["429"], free["503"]) == (3, 1, 1, 1, 1)
    assert free["ttft_p50_ms"] == 500.0 and free["reject_p99_ms"] == pytest.approx(6.0, abs=0.1)
    assert free["refusal_codes"] == {"rate_limit_exceeded": 1, "queue_full": 1}
    assert (plus["fallbacks"], plus["errors"], plus["reject_p99_ms"]) == (1, 1, None)


def test_the_priority_scenario_counts_displacements_as_refusals_and_checks_its_targets():
    from bench.priority import FREE_SERVED, Run, Sample, is_refusal, summarize, targets

    run = Run(
        results=[
            Result("enterprise", "completed", 200, ttft_s=0.2),
            Result("enterprise", "rejected", 503, latency_s=0.01),
            Result("plus", "completed", 200, ttft_s=0.5),
            Result("plus", "rejected", 503, latency_s=0.02),
            Result("plus", "rejected", 503, latency_s=0.02),
            Result("free", "completed", 200, ttft_s=1.0),
            Result("free", "error", 200, code="queue_displaced"),
            Result("free", "rejected", 429, latency_s=0.03),
            Result("free", "rejected", 503, latency_s=0.03),
            Result("free", "rejected", 503, code="queue_displaced", latency_s=0.9),  # waited, then lost its place
        ],
        samples=[Sample(2, 0, 2), Sample(1, 1, 2)],
        waits={"enterprise": [0.5, 3.0], "free": [18.0, 23.5]},
        aging_s=10.0,
    )
    assert is_refusal(run.results[6])
    rows = summarize(run)
    assert [(r["served"], r["refused"], r["displaced"]) for r in rows] == [(1, 1, 0), (1, 2, 0), (1, 4, 2)]
    assert rows[2]["refusal_p99_ms"] == 30.0  # the displaced request's wait is not a refusal's latency
    assert (rows[0]["wait_max_s"], rows[2]["wait_p50_s"]) == (3.0, 20.8)
    checks = {name: ok for name, _, ok in targets(rows, run)}
    assert checks["served share enterprise > plus > free"] and checks[FREE_SERVED]  # 23.5 <= 3 + 20 + 1
    run.waits["free"].append(30.0)  # past enterprise's longest wait + 2 x aging_s: not bounded by aging
    assert not {name: ok for name, _, ok in targets(summarize(run), run)}[FREE_SERVED]
    assert checks["never more in the engine than its capacity (2)"] and checks["refusals p99 < 50 ms"]
    run.samples.append(Sample(2, 1, 2))
    assert not {name: ok for name, _, ok in targets(summarize(run), run)}[
        "never more in the engine than its capacity (2)"
    ]


def test_the_priority_section_replaces_itself_in_results_md(tmp_path):
    from bench.priority import SECTION, write_results

    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Engine\n\nnumbers\n")
    write_results(f"{SECTION}\n\nfirst\n", path)
    write_results(f"{SECTION}\n\nsecond\n", path)
    text = path.read_text()
    assert text.count(SECTION) == 1 and "second" in text and "first" not in text
    assert text.index(SECTION) < text.index("## Engine") and "numbers" in text
