"""engine.amx_prefill measured (part of `make bench`; on a CPU without AMX it says so and exits).

The 390M model of bench_peers (Qwen2.5-0.5B's shape, random weights) stored in bfloat16, as
released checkpoints are, served by the engine with the AMX prefill off (fp32 kernels for every
step) and on (steps of 32+ rows as bf16 on AMX tiles), and by transformers in bfloat16 (which
also reaches AMX through oneDNN) as the peer, all in one run:
- TTFT of one prompt of 1,024 tokens (best of 3, nothing cached);
- 128-token prompts, 32 tokens out, 1 and 8 streams: output tokens/s, prefill included.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_peers import Workload, build_model, run_ours, run_transformers  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from engine.native.kernels import KernelMode, resolve_amx_prefill, supported_modes  # noqa: E402

WORKLOADS = (Workload("qwen-390m", 1, 128, 32), Workload("qwen-390m", 8, 128, 32))


def bf16_copy(source: Path) -> Path:
    """The same weights stored in bfloat16, config.json saying so."""
    from safetensors.torch import load_file, save_file

    target = source.parent / f"{source.name}-bf16"
    if (target / "model.safetensors").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, target / path.name)
        elif path.is_file():
            (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (target / "config.json").write_text(json.dumps(config))
    return target


def ttft_ours(model_dir: Path, amx_prefill: str, prompt_len: int, repeats: int = 3) -> float:
    from engine.native.llm_engine import LLMEngine
    from engine.types import GenerationRequest, SamplingParams
    from settings import EngineConfig

    config = EngineConfig(kv_cache_bytes=512 << 20, max_num_seqs=8, amx_prefill=amx_prefill)
    engine = LLMEngine.from_model_dir(model_dir, config, eos_token_ids=())
    assert engine.runner.amx_prefill == (amx_prefill == "on")
    vocab_size = engine.runner.args.vocab_size
    best = float("inf")
    for r in range(repeats + 1):  # the first warms up
        rng = random.Random(r)  # a new prompt each time: nothing in the prefix cache
        prompt = tuple(rng.randrange(100, vocab_size) for _ in range(prompt_len))
        sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"t{r}", prompt, sampling))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if r:
            best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def ttft_transformers(model_dir: Path, prompt_len: int, repeats: int = 3) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    best = float("inf")
    for r in range(repeats + 1):
        ids = torch.tensor([[random.Random(r).randrange(100, 32000) for _ in range(prompt_len)]])
        start = time.perf_counter()
        model(ids, logits_to_keep=1)
        if r:
            best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    has_amx = KernelMode.AVX512 in supported_modes() and resolve_amx_prefill(
        "auto", mode=KernelMode.AVX512, is_quantized=False, checkpoint_dtype=torch.bfloat16
    )
    info = machine_info(0.0)
    if not has_amx:
        print(f"bench_amx: {info['cpu']} has no AMX (or no avx512 kernels): engine.amx_prefill stays off here")
        return {"machine": info, "skipped": "no AMX"}
    model_dir = bf16_copy(build_model("qwen-390m"))
    result: dict = {"machine": info, "prompt_len": args.prompt_len, "ttft_s": {}, "tokens_per_s": {}}
    result["ttft_s"]["ours fp32 kernels"] = ttft_ours(model_dir, "off", args.prompt_len)
    result["ttft_s"]["ours amx prefill"] = ttft_ours(model_dir, "on", args.prompt_len)
    result["ttft_s"]["transformers bf16"] = ttft_transformers(model_dir, args.prompt_len)
    for w in WORKLOADS:
        name = f"{w.model} x{w.streams}"
        for label, amx in (("ours fp32 kernels", "off"), ("ours amx prefill", "on")):
            tps, _decode = run_ours(model_dir, w, "auto", "none", amx_prefill=amx)
            result["tokens_per_s"][f"{name} {label}"] = tps
        tps, _decode = run_transformers(model_dir, w, dtype=torch.bfloat16)
        result["tokens_per_s"][f"{name} transformers bf16"] = tps

    print(f"machine: {info['cpu']} | 2 torch threads | 390M model stored in bfloat16")
    print(f"TTFT, one {args.prompt_len}-token prompt (best of 3):")
    for label, seconds in result["ttft_s"].items():
        print(f"  {label:<22} {seconds * 1000:8.0f} ms")
    off, on = result["ttft_s"]["ours fp32 kernels"], result["ttft_s"]["ours amx prefill"]
    peer = result["ttft_s"]["transformers bf16"]
    print(f"  amx prefill: {off / on:.2f}x faster than fp32 kernels, {peer / on:.2f}x transformers bf16")
    print("output tokens/s, 128-token prompts, 32 out (prefill included):")
    for label, tps in result["tokens_per_s"].items():
        print(f"  {label:<40} {tps:8.1f}")
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
