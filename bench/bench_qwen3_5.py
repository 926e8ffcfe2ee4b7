"""Qwen3.5 (Gated DeltaNet layers) on the native engine against transformers, same weights, one run.

A random-weight checkpoint of Qwen3.5's layout at about 0.5B parameters (hidden 1,024, 24
layers, three Gated DeltaNet layers to one gated attention layer, 16 key and value heads of
128, vocabulary 32,000; fp32) is built once under build/. Measured: a 512-token prefill, decode
at 1 stream and 8 streams (ours continuously batched, transformers a static batch of 8), and
one Gated DeltaNet layer's decode step with its state update compiled (csrc/gated_delta.c)
against the same step as PyTorch ops. Run: `python -m bench.bench_qwen3_5` (a few minutes); the
AVX2 paths on an AVX-512 machine: `ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
ATEN_CPU_CAPABILITY=avx2 python -m bench.bench_qwen3_5 --kernel-isa avx2`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import in_own_thread, machine_info, measure_matmul_peak_gflops  # noqa: E402
from engine.native.families import LinearAttentionShape  # noqa: E402
from engine.native.kernels import load_kernels, resolve_mode  # noqa: E402
from engine.native.linear_attention import (  # noqa: E402
    LinearAttentionWeights,
    RecurrentBatch,
    RecurrentPools,
    gated_delta_net,
)
from engine.native.llm_engine import LLMEngine  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from settings import EngineConfig  # noqa: E402
from testing.tiny_model import build_tiny_family  # noqa: E402

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    max_position_embeddings=4096,
    initializer_range=0.02,
)
PROMPT, OUTPUT = 512, 32
# Set in the environment to hold PyTorch's own matmuls (transformers', and ours outside the kernels)
# to AVX2 beside engine.kernel_isa = avx2 on an AVX-512 machine: the AVX2 machine's comparison.
_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def build(path: Path) -> Path:
    if not (path / "model.safetensors").exists():
        build_tiny_family(path, "qwen3_5_text", **SHAPE)
    return path


def ours(model_dir: Path, kernel_isa: str) -> dict[str, float]:
    config = EngineConfig(device="cpu", max_num_seqs=8, kernel_isa=kernel_isa)
    engine = LLMEngine.from_model_dir(model_dir, config, eos_token_ids=(2,))

    def run(num_streams: int, prompt_len: int, max_tokens: int) -> tuple[float, float]:
        """(seconds to every stream's first token, decode tokens/s after it)"""
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i in range(num_streams):
            prompt = tuple((3 + i + j) % 32000 for j in range(prompt_len))
            engine.add_request(GenerationRequest(f"{num_streams}-{prompt_len}-{i}", prompt, sampling))
        start, first, tokens = time.perf_counter(), 0.0, 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first:
                tokens += sum(len(out.new_token_ids) for out in outputs)
            elif sum(out.num_completion_tokens > 0 for out in outputs) == num_streams:
                first = time.perf_counter()
        return first - start, tokens / (time.perf_counter() - first)

    run(1, 16, 4)  # warm-up
    prefill_s, one = run(1, PROMPT, OUTPUT)
    _, eight = run(8, 128, OUTPUT)
    return {"prefill_512_s": prefill_s, "decode_1": one, "decode_8": eight}


def transformers_peer(model_dir: Path) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(ids: torch.Tensor, new: int) -> float:
        start = time.perf_counter()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=10**9
        )
        return time.perf_counter() - start

    with torch.inference_mode():
        generate(torch.arange(3, 19)[None], 4)  # warm-up
        one = torch.arange(3, 3 + PROMPT)[None]
        prefill_s = generate(one, 1)
        decode_1 = (OUTPUT - 1) / (generate(one, OUTPUT) - prefill_s)
        eight = torch.stack([torch.arange(3 + i, 3 + i + 128) for i in range(8)])
        first = generate(eight, 1)
        decode_8 = 8 * (OUTPUT - 1) / (generate(eight, OUTPUT) - first)
    return {"prefill_512_s": prefill_s, "decode_1": decode_1, "decode_8": decode_8}


def state_step_ms(kernel_isa: str) -> dict[str, float]:
    """One Gated DeltaNet layer's decode (everything but its two matmuls), compiled state update vs PyTorch's."""
    shape = LinearAttentionShape(16, 16, 128, 128, 4)
    conv = torch.randn(shape.conv_dim, 4)
    weights = LinearAttentionWeights(conv.t().contiguous(), torch.randn(16), -torch.rand(16), torch.randn(128))
    pools = RecurrentPools(shape, 1, 8, torch.device("cpu")).layers[0]
    for pool in pools:
        pool.zero_()
    cpu = load_kernels(resolve_mode(enabled=True, isa=kernel_isa, device=torch.device("cpu"), dtype=torch.float32))
    result = {}
    for rows in (1, 8):
        projected, batch = torch.randn(rows, shape.in_proj_rows), RecurrentBatch(torch.arange(rows), ())
        for name, kernels in (("pytorch", None), (cpu.mode.value, cpu)):
            for _ in range(5):
                gated_delta_net(shape, weights, projected, pools, batch, 1e-6, kernels)
            start = time.perf_counter()
            for _ in range(100):
                gated_delta_net(shape, weights, projected, pools, batch, 1e-6, kernels)
            result[f"{name}_{rows}_rows_ms"] = (time.perf_counter() - start) * 10
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=ROOT / "build" / "bench-qwen3_5")
    p.add_argument("--kernel-isa", default="auto", help="engine.kernel_isa: auto, avx512 or avx2 (the AVX2 sibling)")
    args = p.parse_args(argv)
    model_dir = in_own_thread(build, args.model_dir)
    a, b = ours(model_dir, args.kernel_isa), transformers_peer(model_dir)
    steps = state_step_ms(args.kernel_isa)
    machine = machine_info(in_own_thread(measure_matmul_peak_gflops))
    caps = ", ".join(f"{k}={os.environ[k]}" for k in _ISA_CAPS if k in os.environ) or "uncapped"
    where = f"{machine['cpu']} ({machine['threads']} threads), kernels {args.kernel_isa}, PyTorch's libraries {caps}"
    print(f"\nQwen3.5 layout, ~0.5B fp32, on {where}")
    print(f"{'':<22} {'ours':>8} {'transformers':>13} {'ratio':>6}")
    rows = (
        ("prefill_512_s", "prefill 512 tok (s)"),
        ("decode_1", "decode 1 stream tok/s"),
        ("decode_8", "decode 8 streams tok/s"),
    )
    for key, label in rows:  # ratio: how many times faster ours is
        ratio = b[key] / a[key] if key.endswith("_s") else a[key] / b[key]
        print(f"{label:<22} {a[key]:>8.2f} {b[key]:>13.2f} {ratio:>5.2f}x")
    print("one Gated DeltaNet layer's decode, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in steps.items()))
    line = {"machine": machine, "ours": a, "transformers": b, "state_step": steps}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
