"""int8 and int4 weights (engine.quantization = "int8" / "int4"): the engine computes the rounded
model exactly (greedy output equal to transformers running the same rounded weights, on every
kernel path this CPU can run), and the rounding costs little (int8) or some (int4) quality
against fp32 on the bundled demo model."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from bench.quant_quality import measure, rounded_like
from engine.native.kernels import KernelMode
from engine.native.loader import load_model_args
from engine.native.quant import Quantization
from engine.types import GenerationRequest, SamplingParams
from kernel_modes import ALL_MODES
from test_greedy_equality import engine_for, run_with_arrivals


def transformers_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample, config.pad_token_id, config.eos_token_id = max_tokens, False, 0, 10**9
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("quantization", [Quantization.INT8, Quantization.INT4], ids=["int8", "int4"])
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("variant", ["tied-gqa-parameters", "qwen2-qkv-bias"])
def test_quantized_engine_matches_transformers_on_the_rounded_weights_token_for_token(
    tiny_models, variant, mode, quantization
):
    model_dir = tiny_models.path(variant)
    reference = rounded_like(tiny_models.reference(variant), quantization)
    engine = engine_for(model_dir, num_blocks=48, kernel_isa=mode.value, quantization=quantization.value)
    assert engine.runner.kernel_mode is mode and engine.runner.quantization is quantization
    if mode is not KernelMode.TORCH:
        qkv = engine.runner.model.weights.layers[0].qkv
        assert qkv.bits == quantization.bits and qkv.panels.dtype == (torch.int8 if qkv.bits == 8 else torch.uint8)
    rng = random.Random(7)
    vocab_size = load_model_args(model_dir).vocab_size
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 9, 40, 70)]
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    arrivals = [(i, GenerationRequest(f"r{i}", tuple(p), sampling)) for i, p in enumerate(prompts)]
    expected = {f"r{i}": transformers_greedy(reference, p, 16) for i, p in enumerate(prompts)}
    assert run_with_arrivals(engine, arrivals) == expected


def test_int8_costs_little_quality_on_the_demo_model():
    # Loose bounds: measured 2026-11-23 (bench/RESULTS.md), perplexity within 1% and most greedy tokens equal.
    quality = measure(limit=4, max_tokens=16)
    assert quality.perplexity_quantized < 1.05 * quality.perplexity_fp32, quality
    assert quality.greedy_agreement >= 0.5, quality


@pytest.mark.parametrize("quantization", [Quantization.INT8, Quantization.INT4])
def test_a_tall_matrix_is_rounded_in_row_chunks_with_the_same_result(quantization, monkeypatch):
    """Rows are independent: chunking bounds the load's float temporaries and changes no value."""
    from engine.native import quant

    weight = torch.randn(2 * 64 + 5, 70)  # ragged: neither rows nor inputs a multiple of the chunk or group
    whole = quant.quantize(weight, quantization)
    monkeypatch.setattr(quant, "_QUANTIZE_ROWS", 64)
    chunked = quant.quantize(weight, quantization)
    assert torch.equal(chunked.q, whole.q) and torch.equal(chunked.scales, whole.scales)
    assert chunked.q.shape == (2 * 64 + 5, 70) and chunked.scales.shape == (2 * 64 + 5, 3)
