"""bench/bench_families.py's pure parts: every family's reference-size config is one the engine
serves with its features on, and the rows compare each family with Llama from the same run."""

from __future__ import annotations

import pytest

from bench.bench_engine import REFERENCE, LoadResult
from bench.bench_families import FAMILY_CONFIGS, rows_for
from engine.native.families import model_args_from_config


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_each_family_config_at_the_reference_size_is_served(family):
    from transformers import CONFIG_MAPPING

    cfg = dict(FAMILY_CONFIGS[family])
    args = model_args_from_config(CONFIG_MAPPING[cfg.pop("model_type")](**REFERENCE, **cfg))
    assert args.hidden_size == REFERENCE["hidden_size"] and args.num_layers == REFERENCE["num_hidden_layers"]
    # The fused CPU path: Llama's layer, with per-head q/k norms (Qwen3), layers without RoPE
    # (SmolLM3) or Granite's multipliers folded in; the others take the general path.
    assert args.is_llama_like == (family in ("llama", "qwen3", "smollm3", "granite"))


def test_rows_give_each_family_its_speed_relative_to_llama():
    def result(tps: float) -> LoadResult:
        return LoadResult("engine", 1, 4, 1.0, 512, 256, tps, 1.0, 1.0, 10.0, 12.0)

    rows = rows_for({"llama": ("decode_stack", {1: result(100.0)}), "gemma2": ("general", {1: result(50.0)})})
    assert [(r.family, r.path, r.vs_llama) for r in rows] == [
        ("llama", "decode_stack", 1.0),
        ("gemma2", "general", 0.5),
    ]
