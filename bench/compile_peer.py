"""torch.compile (inductor, CPU) against the engine's C kernels for decoding (issue #22).

One run, the 30M reference model (bench/workload.py's REFERENCE, random weights), the same random
prompts for every path, greedy, EOS ignored: the engine in process (its kernel mode, and PyTorch
ops), transformers eager, and transformers with a static KV cache and `torch.compile`d forward
(inductor's default mode, and with `freezing`, which folds the weights and prepacks them for
oneDNN). Prints decode tokens/s (after the prefill) per path and stream count, and one JSON line.
Usage: python -m bench.compile_peer [--streams 1,32] [--output-len 64]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_peers import Workload, build_model, run_ours, run_transformers  # noqa: E402
from bench.llamacpp_peer import make_prompts  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from engine.native import kernels  # noqa: E402


@torch.inference_mode()
def run_compiled(model_dir: Path, w: Workload, *, freezing: bool) -> tuple[float, float, float]:
    """(out tok/s, decode tok/s, compile seconds) of transformers' generate with a static cache
    and the forward compiled by inductor."""
    import torch._inductor.config as inductor_config
    from transformers import AutoModelForCausalLM

    inductor_config.freezing = freezing
    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.forward = torch.compile(model.forward, dynamic=False)
    ids = torch.tensor(make_prompts(w.streams, w.prompt_len, model.config.vocab_size, seed=w.streams))

    def generate(max_tokens: int) -> float:
        config = copy.deepcopy(model.generation_config)
        config.max_new_tokens, config.min_new_tokens, config.do_sample = max_tokens, max_tokens, False
        config.eos_token_id, config.pad_token_id = 10**9, 0
        config.cache_implementation = "static"
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return time.perf_counter() - start

    compile_s = generate(w.output_len)  # compiles the prefill and the decode graphs
    prefill_s, total_s = generate(1), generate(w.output_len)
    n = w.streams
    return n * w.output_len / total_s, n * (w.output_len - 1) / (total_s - prefill_s), compile_s


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,32")
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args(argv)
    model_dir = build_model("ref-30m")
    mode = kernels.resolve_mode(enabled=True, isa="auto", device=torch.device("cpu"), dtype=torch.float32)
    rows = []
    for streams in (int(s) for s in args.streams.split(",")):
        w = Workload("ref-30m", streams, 128, args.output_len)
        paths = {
            f"ours {mode.value}": lambda w=w: (*run_ours(model_dir, w, "auto", "none"), 0.0),
            "ours PyTorch ops": lambda w=w: (*run_ours(model_dir, w, "torch", "none"), 0.0),
            "transformers eager": lambda w=w: (*run_transformers(model_dir, w), 0.0),
            "transformers torch.compile": lambda w=w: run_compiled(model_dir, w, freezing=False),
            "transformers torch.compile freezing": lambda w=w: run_compiled(model_dir, w, freezing=True),
        }
        for name, fn in paths.items():
            out, decode, compile_s = fn()
            rows.append(
                {"streams": streams, "path": name, "out_tok_s": out, "decode_tok_s": decode, "compile_s": compile_s}
            )
            print(
                f"{streams:>3} streams  {name:38} out {out:8.1f} tok/s  decode {decode:8.1f} tok/s"
                + (f"  (first call, compiling: {compile_s:.0f} s)" if compile_s else ""),
                flush=True,
            )
    record = {"machine": machine_info(0.0), "kernel_mode": mode.value, "rows": rows}
    print(json.dumps(record, default=float))
    return record


if __name__ == "__main__":
    main()
