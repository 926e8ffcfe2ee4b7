"""bench/bench_safety.py's pure part: medians per server variant and the ratios to safety off."""

from __future__ import annotations

import pytest

from bench.bench_safety import RoundResult, summarize


def test_summary_takes_medians_per_variant_and_checks_both_targets_against_off():
    rounds = [
        RoundResult("off", 0, 1000.0, 0, 20.0, 200.0),
        RoundResult("on", 0, 950.0, 0, 30.0, 210.0),
        RoundResult("off", 1, 1200.0, 0, 22.0, 200.0),
        RoundResult("on", 1, 850.0, 1, 24.0, 210.0),
    ]
    out = summarize(rounds)
    assert out["median"]["off"] == {"tokens_per_s": 1100.0, "ttft_ms_warm": 21.0}
    assert out["on"]["throughput_ratio"] == pytest.approx(900 / 1100)
    assert out["on"]["ttft_ratio"] == pytest.approx(27 / 21)
    assert out["on"]["pass"] == {"throughput_ge_0.9x_off": False, "warm_ttft_le_1.3x_off": True}
    assert "off" not in {k for k in out if k != "median"}
