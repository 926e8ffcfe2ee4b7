"""Where a decode step's time goes, on any device (`python -m bench.step_profile --device cuda`).

The 30M reference of bench_engine, N streams of 128-token prompts decoding 128 tokens each:
1. the engine stepped directly in one thread: the median decode-only step, and a cProfile of
   those steps (the functions with the most time of their own);
2. the same load behind NativeBackend (the step thread beside the event loop that serves the
   streams), at each of the given GIL switch intervals: the median `LLMEngine.step` inside the
   step thread and the inter-token latency the streams saw.
The gap between 1 and 2 is what the event loop and the step thread cost each other.
`--sdpa-check` (CUDA): decode-shaped attention over a context growing by one, as the engine's
steps run it, on the cuDNN backend and on the others (runner.use_cuda_attention_backends).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import in_own_thread  # noqa: E402
from bench.workload import (  # noqa: E402
    backend_generate,
    build_reference_model,
    make_chat_requests,
    run_load,
)
from engine.native.backend import NativeBackend  # noqa: E402
from engine.native.llm_engine import LLMEngine  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from settings import EngineConfig  # noqa: E402


def config(args) -> EngineConfig:
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        kernel_isa=args.kernel_isa,
        kv_cache_bytes=512 << 20,
        max_num_seqs=64,
        cuda_graphs=args.cuda_graphs,
    )


def direct(model_dir: Path, args, requests) -> dict:
    engine = LLMEngine.from_model_dir(model_dir, config(args), eos_token_ids=())

    def run(tag: str, profile: cProfile.Profile | None) -> list[float]:
        for r in requests:
            sampling = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(GenerationRequest(tag + r.request_id, r.prompt_token_ids, sampling))
        steps = []
        while engine.has_unfinished_requests():
            decoding = not engine.scheduler.waiting and all(s.num_computed_tokens > 0 for s in engine.scheduler.running)
            start = time.perf_counter()
            if profile is not None and decoding:
                profile.enable()
            engine.step()
            if profile is not None:
                profile.disable()
            if decoding:
                steps.append((time.perf_counter() - start) * 1e3)
        return steps

    run("warm", None)
    steps = run("timed", None)
    profile = cProfile.Profile()
    run("profiled", profile)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
    return {"step_ms_median": statistics.median(steps), "decode_steps": len(steps), "profile": text.getvalue()}


async def behind_backend(model_dir: Path, args, requests, switch_interval: float) -> dict:
    steps: list[float] = []
    step_cpu: list[float] = []  # the step thread's own CPU time per step: wall minus this is waiting (the GIL)
    original = LLMEngine.step

    def timed_step(self):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(self)
        finally:
            steps.append((time.perf_counter() - start) * 1e3)
            step_cpu.append((time.thread_time() - cpu) * 1e3)

    LLMEngine.step = timed_step  # type: ignore[method-assign]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    backend = NativeBackend(model_dir, config(args), Tokenizer.from_dir(model_dir))
    await backend.start()
    try:
        generate = backend_generate(backend)
        await run_load("warm", generate, requests[: args.streams], args.streams)
        steps.clear()
        step_cpu.clear()
        loop_cpu, wall = time.thread_time(), time.perf_counter()
        result = await run_load("timed", generate, requests, args.streams)
        loop_share = (time.thread_time() - loop_cpu) / (time.perf_counter() - wall)
    finally:
        await backend.shutdown()
        sys.setswitchinterval(previous)
        LLMEngine.step = original  # type: ignore[method-assign]
    return {
        "switch_interval_ms": switch_interval * 1e3,
        "engine_step_ms_median": statistics.median(steps),
        "engine_step_cpu_ms_median": statistics.median(step_cpu),
        "event_loop_busy": loop_share,
        "itl_ms_p50": result.itl_ms_p50,
        "out_tok_s": result.output_tokens_per_s,
    }


def sdpa_check(device: str, lengths: range, batch: int = 32) -> dict[str, float]:
    """ms per call of a decode step's SDPA (bf16, GQA 8/2 heads of 64, a bool mask) as the
    context grows by one per call: with only cuDNN allowed, and with flash/efficient/math."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name, backends in (
        ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
        ("others", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
    ):
        with sdpa_kernel(backends):
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                for n in lengths:
                    q = torch.randn(batch, 8, 1, 64, device=device, dtype=torch.bfloat16)
                    kv = torch.randn(batch, 2, n, 64, device=device, dtype=torch.bfloat16)
                    mask = torch.ones(batch, 1, 1, n, device=device, dtype=torch.bool)
                    F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
                torch.cuda.synchronize()
            except RuntimeError as exc:  # this backend cannot take these inputs
                print(f"SDPA {name}: {str(exc).splitlines()[0]}")
                continue
            out[name] = (time.perf_counter() - start) * 1e3 / len(lengths)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kernel-isa", default="auto", help="engine.kernel_isa on a CPU (torch: PyTorch ops, as on CUDA)")
    p.add_argument("--cuda-graphs", default="auto", help="engine.cuda_graphs: auto, off or eager")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--switch-intervals", default="0.005,0.0005", help="GIL switch intervals (s) to try; empty: the direct run only"
    )
    p.add_argument("--top", type=int, default=25, help="profile rows printed")
    p.add_argument("--model-dir", type=Path, default=ROOT / "build" / "bench-model-v2")
    p.add_argument("--sdpa-check", action="store_true", help="only time SDPA's CUDA backends on growing contexts")
    args = p.parse_args(argv)
    if args.sdpa_check:
        for name, ms in sdpa_check(args.device, range(129, 193)).items():
            print(f"SDPA, 32 decode rows, context 129..192 growing by one per call: {name} {ms:.2f} ms per call")
        return
    model_dir = in_own_thread(build_reference_model, args.model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    requests = make_chat_requests(tokenizer, 2 * args.streams, 128, args.output_len, seed=5, prefix="p")
    d = in_own_thread(direct, model_dir, args, requests[: args.streams])
    median, n = d["step_ms_median"], d["decode_steps"]
    print(f"direct: {args.streams} streams, median decode step {median:.2f} ms ({n} steps)")
    print(d["profile"])
    for interval in (float(x) for x in args.switch_intervals.split(",") if x):
        b = asyncio.run(behind_backend(model_dir, args, requests, interval))
        print(
            f"behind NativeBackend, switch interval {b['switch_interval_ms']:.1f} ms: engine step median "
            f"{b['engine_step_ms_median']:.2f} ms ({b['engine_step_cpu_ms_median']:.2f} ms of its CPU), "
            f"event loop busy {b['event_loop_busy']:.0%} of the wall, "
            f"ITL p50 {b['itl_ms_p50']:.2f} ms, {b['out_tok_s']:.0f} tok/s"
        )


if __name__ == "__main__":
    main()
