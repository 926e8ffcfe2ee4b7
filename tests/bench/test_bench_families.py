"""bench/bench_families.py's pure parts: every family's reference-size config is one the engine
serves with its features on, and the rows compare each family with Llama from the same run."""

from __future__ import annotations

import pytest

from bench.bench_families import FAMILY_CONFIGS, rows_for
from bench.workload import REFERENCE, LoadResult
from engine.native.families import model_args_from_config


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_each_family_config_at_the_reference_size_is_served(family):
    from transformers import CONFIG_MAPPING

    cfg = dict(FAMILY_CONFIGS[family])
    args = model_args_from_config(CONFIG_MAPPING[cfg.pop("model_type")](**REFERENCE, **cfg))
    assert args.hidden_size == REFERENCE["hidden_size"] and args.num_layers == REFERENCE["num_hidden_layers"]
    # Every family's decode-only steps run as one C call (decode_step.c) but Qwen3.5's (Gated
    # DeltaNet layers: the general path around a compiled state step); prefill steps take the
    # fused CPU path for Llama's layer, with per-head q/k norms (Qwen3), layers without RoPE
    # (SmolLM3), Granite's multipliers folded in or ERNIE 4.5's interleaved rope reordered at
    # load, and the general path for the others.
    assert args.fits_decode_stack == (family != "qwen3_5")
    assert args.is_llama_like == (family in ("llama", "qwen3", "smollm3", "granite", "ernie4_5"))


def result(tps: float) -> LoadResult:
    return LoadResult("engine", 1, 4, 1.0, 512, 256, tps, 1.0, 1.0, 10.0, 12.0)


def test_rows_give_each_family_its_speed_relative_to_llama():
    rows = rows_for({"llama": ("decode_stack", [{1: result(100.0)}]), "gemma2": ("general", [{1: result(50.0)}])})
    assert [(r.family, r.path, r.vs_llama, r.worst_tokens_per_s) for r in rows] == [
        ("llama", "decode_stack", 1.0, 100.0),
        ("gemma2", "general", 0.5, 50.0),
    ]


def test_rows_keep_each_familys_best_round_and_show_its_worst():
    # Llama's slow second round and Gemma's slow first one must not skew the ratio.
    llama = [{1: result(100.0), 32: result(400.0)}, {1: result(60.0), 32: result(390.0)}]
    gemma = [{1: result(20.0), 32: result(300.0)}, {1: result(80.0), 32: result(200.0)}]
    rows = rows_for({"llama": ("decode_stack", llama), "gemma2": ("general", gemma)})
    assert [(r.family, r.concurrency, r.output_tokens_per_s, r.vs_llama, r.worst_tokens_per_s) for r in rows] == [
        ("llama", 1, 100.0, 1.0, 60.0),
        ("llama", 32, 400.0, 1.0, 390.0),
        ("gemma2", 1, 80.0, 0.8, 20.0),
        ("gemma2", 32, 300.0, 0.75, 200.0),
    ]
