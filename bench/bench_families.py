"""Native-engine throughput per served family at the reference size (part of `make bench`).

One random-weight checkpoint per family, each the shape of bench_engine.py's reference model
(8 layers, hidden 512, 8 heads / 2 KV heads, vocab 8192) with the family's own features on,
is run through the engine directly at concurrency 1 and 32. Each row names the path its
layers took: decode-only steps (one C call per step, fused C ops, or the general path: PyTorch
ops around C matmuls), then prefill steps (fused C ops or the general path),
and its speed as a ratio to Llama measured in the same run, so a family that falls off the
fast path is visible. The families are measured in rounds (every family once per round) and
each row keeps its best round, with its worst beside it: on a shared machine a neighbour's
burst slows one measurement, not the whole row. Run: `python -m bench.bench_families [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import in_own_thread, machine_info, measure_matmul_peak_gflops  # noqa: E402
from bench.workload import (  # noqa: E402
    REFERENCE,
    backend_generate,
    build_reference_model,
    make_requests,
    run_load,
)
from engine.native.backend import NativeBackend  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from settings import EngineConfig  # noqa: E402
from testing.tiny_model import build_tiny_family  # noqa: E402

_HEAD_DIM = REFERENCE["hidden_size"] // REFERENCE["num_attention_heads"]
_SLIDING = ["sliding_attention"] * 5 + ["full_attention"]
# What each family switches on, at the sizes its released checkpoints use where they apply.
FAMILY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3", head_dim=_HEAD_DIM),
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=_HEAD_DIM,
        query_pre_attn_scalar=_HEAD_DIM,
        sliding_window=512,
        layer_types=(_SLIDING * 2)[: REFERENCE["num_hidden_layers"]],
    ),
    "gemma2": dict(
        model_type="gemma2",
        head_dim=_HEAD_DIM,
        query_pre_attn_scalar=_HEAD_DIM,
        sliding_window=512,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.75),
    "smollm3": dict(model_type="smollm3"),
    "mistral-sliding": dict(model_type="mistral", sliding_window=4096),
    "granite": dict(
        model_type="granite",
        embedding_multiplier=12.0,
        attention_multiplier=0.015625,
        residual_multiplier=0.22,
        logits_scaling=8.0,
    ),
    "olmo2": dict(model_type="olmo2"),
    "ernie4_5": dict(model_type="ernie4_5", head_dim=_HEAD_DIM),
    "glm4": dict(model_type="glm4", head_dim=_HEAD_DIM, attention_bias=True),
    # Three Gated DeltaNet layers to one gated attention layer; value heads twice the key heads
    "qwen3_5": dict(
        model_type="qwen3_5_text",
        head_dim=_HEAD_DIM,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (REFERENCE["num_hidden_layers"] // 4),
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=_HEAD_DIM,
        linear_value_head_dim=_HEAD_DIM,
    ),
}


@dataclass(frozen=True, slots=True)
class FamilyRow:
    family: str
    path: str  # decode-only steps (decode_stack: one C call | fused_ops | general) + prefill steps' path
    concurrency: int
    output_tokens_per_s: float  # the best round's
    vs_llama: float  # this family's tokens/s over Llama's at the same concurrency, same run
    itl_ms_p50: float
    worst_tokens_per_s: float  # the slowest round's (as the best when there is one round)


def build_family(root: Path, family: str, reference_dir: Path) -> Path:
    """The family's checkpoint at the reference size, with the reference model's tokenizer."""
    path = root / family
    if not (path / "model.safetensors").exists():
        build_tiny_family(path, seed=0, initializer_range=0.02, **REFERENCE, **FAMILY_CONFIGS[family])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(reference_dir / name, path / name)
    return path


async def bench_family(
    model_dir: Path, config: EngineConfig, loads: dict[int, tuple[int, int, int]]
) -> tuple[str, dict]:
    backend = NativeBackend(model_dir, config, Tokenizer.from_dir(model_dir))
    await backend.start()
    try:
        generate = backend_generate(backend)
        await run_load("warmup", generate, make_requests(4, 64, 8, seed=1, prefix="w"), 4)
        results = {}
        for concurrency, (num_requests, prompt_len, output_len) in loads.items():
            requests = make_requests(num_requests, prompt_len, output_len, seed=concurrency, prefix=f"c{concurrency}-")
            results[concurrency] = await run_load("engine", generate, requests, concurrency)
        model = backend.engine.runner.model
        path = "decode_stack" if model.uses_decode_stack else "fused_ops" if model.fused_cpu_ops else "general"
        # Prefill and mixed steps: one compiled call per operation (Llama-like), else the general path.
        path += "+fused_ops" if model.fused_cpu_ops else "+general"
        return path, results
    finally:
        await backend.shutdown()


def _isa() -> str:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"


def best_of(rounds: list[dict]) -> tuple[dict, dict]:
    """Per concurrency, the fastest round's result and the slowest round's tokens/s."""
    best = {c: max((r[c] for r in rounds), key=lambda x: x.output_tokens_per_s) for c in rounds[0]}
    worst = {c: min(r[c].output_tokens_per_s for r in rounds) for c in rounds[0]}
    return best, worst


def rows_for(measured: dict[str, tuple[str, list[dict]]]) -> list[FamilyRow]:
    """measured: family -> (path, one {concurrency: LoadResult} per round)."""
    llama, _ = best_of(measured["llama"][1])
    rows = []
    for family, (path, rounds) in measured.items():
        best, worst = best_of(rounds)
        for c, r in best.items():
            tps = r.output_tokens_per_s
            ratio = round(tps / llama[c].output_tokens_per_s, 2)
            rows.append(FamilyRow(family, path, c, round(tps, 1), ratio, round(r.itl_ms_p50, 1), round(worst[c], 1)))
    return rows


def main(argv: list[str] | None = None) -> list[FamilyRow]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests and tokens")
    p.add_argument("--root", type=Path, default=ROOT / "build" / "bench-families")
    p.add_argument("--reference-dir", type=Path, default=ROOT / "build" / "bench-model-v2")
    p.add_argument("--families", default=",".join(FAMILY_CONFIGS))
    p.add_argument("--rounds", type=int, default=2, help="measure every family this many times, keep the best")
    p.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    output_len = 16 if args.quick else 64
    loads = {1: (2 if args.quick else 4, 128, output_len), 32: (32, 128, output_len)}
    reference_dir = in_own_thread(build_reference_model, args.reference_dir)
    config = EngineConfig(device="cpu", kv_cache_bytes=1024 << 20, max_num_seqs=64)
    families = ["llama", *[f for f in args.families.split(",") if f != "llama"]]
    model_dirs = {family: in_own_thread(build_family, args.root, family, reference_dir) for family in families}
    measured: dict[str, tuple[str, list[dict]]] = {family: ("", []) for family in families}
    for _ in range(args.rounds):  # every family once per round: a slow spell hits one round of each
        for family in families:
            path, results = asyncio.run(bench_family(model_dirs[family], config, loads))
            measured[family] = (path, [*measured[family][1], results])
    rows = rows_for(measured)
    machine = machine_info(in_own_thread(measure_matmul_peak_gflops))
    machine["isa"] = _isa()
    where = f"{machine['cpu']} ({machine['isa']}, {machine['threads']} threads)"
    print(f"\nNative engine per family, reference size, on {where}; best of {args.rounds} rounds")
    print(f"{'family':<16} {'path':<22} {'conc':>4} {'tok/s':>8} {'vs llama':>8} {'ITL p50 ms':>10} {'worst':>8}")
    for r in rows:
        print(
            f"{r.family:<16} {r.path:<22} {r.concurrency:>4} {r.output_tokens_per_s:>8.1f} {r.vs_llama:>8.2f} "
            f"{r.itl_ms_p50:>10.1f} {r.worst_tokens_per_s:>8.1f}"
        )
    line = json.dumps({"machine": machine, "rounds": args.rounds, "families": [asdict(r) for r in rows]})
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return rows


if __name__ == "__main__":
    main()
