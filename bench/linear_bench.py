"""Our packed linear kernels against torch's library kernels on one decode step's matmuls.

Every linear layer of a model (q/k/v fused, o, gate/up fused, down, per layer, then lm_head),
chained, at the row counts a decode step has. Library paths: F.linear (oneDNN/MKL sgemm, which
re-packs the weight on every call), oneDNN with the weight prepacked for the row count
(torch.ops.mkldnn, what torch.compile's CPU freezing uses), MKL's packed sgemm
(torch.ops.mkl), and torch's weight-only int8 matmul (per-channel scales). Ours: fp32 and int8
for each instruction set this CPU has. Run by bench_peers.py; alone: `python -m bench.linear_bench`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.native import kernels  # noqa: E402
from engine.native.quant import Quantization  # noqa: E402

ROW_COUNTS = (1, 8, 32)


def step_shapes(shape: dict) -> list[tuple[int, int]]:
    """(out_features, in_features) of every matmul of one step, in order."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = h // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * head_dim
    layer = [(qkv, h), (h, shape["num_attention_heads"] * head_dim), (2 * inter, h), (h, inter)]
    return layer * shape["num_hidden_layers"] + [(shape["vocab_size"], h)]


def _time_ms(chain: Callable[[], None], repeats: int = 5) -> float:
    chain()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        chain()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _library_paths(weights: list[torch.Tensor], rows: int) -> dict[str, Callable[[list[torch.Tensor]], None]]:
    paths: dict[str, Callable] = {
        "torch F.linear": lambda xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)]
    }
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        paths["oneDNN prepacked"] = lambda xs: [
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed, strict=True)
        ]
    except (RuntimeError, AttributeError):
        pass
    try:
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        paths["MKL packed sgemm"] = lambda xs: [
            torch.ops.mkl._mkl_linear(x, p, w, None, rows) for x, p, w in zip(xs, mkl, weights, strict=True)
        ]
    except (RuntimeError, AttributeError):
        pass
    try:
        int8 = []
        for w in weights:
            scales = w.abs().amax(dim=1) / 127.0
            int8.append((torch.round(w / scales[:, None]).to(torch.int8), scales))
        paths["torch int8 weight-only"] = lambda xs: [
            torch._weight_int8pack_mm(x, q, s) for x, (q, s) in zip(xs, int8, strict=True)
        ]
    except (RuntimeError, AttributeError):
        pass
    return paths


def main(shape: dict) -> dict:
    torch.manual_seed(0)
    shapes = step_shapes(shape)
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    results: dict[str, dict[int, float]] = {}
    for rows in ROW_COUNTS:
        inputs = [torch.randn(rows, k) for _, k in shapes]
        for name, run in _library_paths(weights, rows).items():
            try:
                results.setdefault(name, {})[rows] = _time_ms(lambda run=run, inputs=inputs: run(inputs))
            except RuntimeError as exc:
                print(f"  {name} at {rows} rows failed: {exc}")
    for mode in kernels.supported_modes():
        cpu = kernels.load_kernels(mode)
        for quantization in Quantization:
            packed = [cpu.pack_linear(w, quantization) for w in weights]
            label = f"ours {mode.value} {'int8' if quantization is Quantization.INT8 else 'fp32'}"
            for rows in ROW_COUNTS:
                inputs = [torch.randn(rows, k) for _, k in shapes]
                step = [(x, p) for x, p in zip(inputs, packed, strict=True)]
                results.setdefault(label, {})[rows] = _time_ms(
                    lambda cpu=cpu, step=step: [cpu.packed_linear(x, p) for x, p in step]
                )
            del packed
    num_weights_m = sum(n * k for n, k in shapes) / 1e6
    print(f"one step's {len(shapes)} matmuls ({num_weights_m:.0f}M weights), ms per step (best of 5):")
    print(f"  {'path':26}" + "".join(f"{f'{r} rows':>10}" for r in ROW_COUNTS))
    for name, by_rows in results.items():
        print(f"  {name:26}" + "".join(f"{by_rows.get(r, float('nan')):>10.2f}" for r in ROW_COUNTS))
    return {name: {str(r): ms for r, ms in by_rows.items()} for name, by_rows in results.items()}


if __name__ == "__main__":
    from bench.bench_peers import QWEN_390M

    main(QWEN_390M)
