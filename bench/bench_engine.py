"""Engine benchmark (`make bench`): the native engine against transformers on one machine, one run.

Reference model: Llama, vocab 8192, hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate
1408, tied embeddings, random weights (seed 0), fp32. Prints one table and one JSON line:
throughput, TTFT and inter-token latency per concurrency; transformers baselines (on the
engine's device, in its dtype: `--device cuda` runs both on a GPU); the fraction of the
measured matmul peak; the chunked-prefill ITL test and the prefix-cache TTFT test.
Other paths (the HTTP server) plug in through bench/workload.py's `run_load(name, generate,
requests, concurrency)`. This module is the CLI, the sections and the driver; the workload, the
machine, the transformers peer, the mechanism tests and the report live in their own modules.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/bench_engine.py` as well as `python -m bench.bench_engine`

from bench.bench_structured import print_structured, structured_overhead  # noqa: E402
from bench.engine_report import checks, print_report, print_restart  # noqa: E402
from bench.machine import in_own_thread, machine_info, measure_matmul_peak_gflops  # noqa: E402
from bench.mechanisms import chunked_prefill_itl, prefix_cache_ttft, restart_ttft  # noqa: E402
from bench.transformers_peer import bench_transformers  # noqa: E402
from bench.workload import (  # noqa: E402
    FULL,
    QUICK,
    GenerateFn,
    LoadResult,
    Plan,
    backend_generate,
    build_reference_model,
    http_generate,
    load_requests,
    make_chat_requests,
    run_load,
    with_fraction,
    workload_flops,
)
from engine.native.backend import NativeBackend  # noqa: E402
from engine.native.runner import resolve_device, resolve_dtype  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from settings import EngineConfig  # noqa: E402

SECTIONS = ("engine", "http", "transformers", "chunked", "prefix", "restart", "structured")


def captures_graphs(args) -> bool:
    """Whether the engine replays CUDA graphs (captured the first time a shape is needed)."""
    return args.cuda_graphs == "auto" and resolve_device(args.device).type == "cuda"


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_mb << 20,
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        native_kernels=not args.no_kernel,
        kernel_isa=args.kernel_isa,
        quantization=args.quantization,
        cuda_graphs=args.cuda_graphs,
    )


async def run_loads(
    name: str, generate: GenerateFn, tokenizer: Tokenizer, plan: Plan, peak_gflops: float, *, warm_each: bool = False
) -> list[LoadResult]:
    """warm_each (CUDA graphs): before each concurrency, `c` requests of the load's shape, so the
    decode graphs its batch sizes and context lengths need are captured outside the timing."""
    await run_load("warmup", generate, make_chat_requests(tokenizer, 8, plan.prompt_len, 8, seed=1, prefix="w"), 8)
    flops = workload_flops(plan.prompt_len, plan.output_len, plan.num_requests)
    results = []
    for c in plan.concurrencies:
        if warm_each:
            warm = make_chat_requests(tokenizer, c, plan.prompt_len, plan.output_len, seed=1000 + c, prefix=f"w{c}-")
            await run_load("warmup", generate, warm, c)
        results.append(
            with_fraction(await run_load(name, generate, load_requests(tokenizer, plan, c), c), flops, peak_gflops)
        )
    return results


async def bench_engine(model_dir: Path, plan: Plan, args, peak_gflops: float, sections: set[str]) -> dict:
    tokenizer = Tokenizer.from_dir(model_dir)
    backend = NativeBackend(model_dir, engine_config(args), tokenizer)
    await backend.start()
    out: dict = {}
    try:
        generate = backend_generate(backend)
        if "engine" in sections:
            out["engine"] = await run_loads(
                "native engine", generate, tokenizer, plan, peak_gflops, warm_each=captures_graphs(args)
            )
        if "chunked" in sections:
            out["chunked_prefill"] = await chunked_prefill_itl(
                backend, num_streams=16, long_prompt_len=plan.long_prompt_len
            )
        if "prefix" in sections:
            out["prefix_cache"] = await prefix_cache_ttft(backend, system_len=plan.system_prompt_len, repeats=3)
        if "structured" in sections:  # bench/bench_structured.py
            prompt = load_requests(tokenizer, plan, 1)[0].prompt_token_ids
            out["structured"] = await structured_overhead(backend, prompt)
        return out
    finally:
        await backend.shutdown()


async def bench_http(model_dir: Path, plan: Plan, args, peak_gflops: float) -> list[LoadResult]:
    """The same load through `server.py` in its own process, read by a streaming HTTP client."""
    import tempfile

    import aiohttp

    from testing.server_proc import ServerProcess

    cfg = engine_config(args)
    overrides = {
        "safety.enabled": "false",  # the engine comparison; the gate's cost: bench/bench_safety.py
        "engine.device": cfg.device,
        "engine.dtype": cfg.dtype,
        "engine.kv_cache_bytes": cfg.kv_cache_bytes,
        "engine.max_num_seqs": cfg.max_num_seqs,
        "engine.max_num_batched_tokens": cfg.max_num_batched_tokens,
        "engine.max_prefill_tokens_while_decoding": cfg.max_prefill_tokens_while_decoding,
        "engine.native_kernels": str(cfg.native_kernels).lower(),
        "engine.kernel_isa": cfg.kernel_isa,
        "engine.quantization": cfg.quantization,
        "engine.cuda_graphs": cfg.cuda_graphs,
        "server.log_level": "warning",
        "tiers.enterprise.max_concurrent_streams": 1000,  # keyless loopback requests are enterprise
        "tiers.enterprise.requests_per_minute": 100_000,
        "tiers.enterprise.tokens_per_minute": 100_000_000,
    }
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--model", str(model_dir), "--db", str(Path(tmp) / "bench.db")]
        for key, value in overrides.items():
            argv += ["--set", f"{key}={value}"]
        with ServerProcess(argv, log_path=Path(tmp) / "server.log") as server:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                async with session.get(f"{server.base_url}/v1/models") as resp:
                    model = (await resp.json())["data"][0]["id"]
                generate = http_generate(session, server.base_url, model)
                return await run_loads(
                    "HTTP server (streaming client)",
                    generate,
                    Tokenizer.from_dir(model_dir),
                    plan,
                    peak_gflops,
                    warm_each=captures_graphs(args),
                )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short run for iterating (fewer requests and tokens)")
    p.add_argument(
        "--model-dir", type=Path, default=ROOT / "build" / "bench-model-v2", help="where the reference model lives"
    )
    p.add_argument("--device", default="auto", help="engine.device: auto, cpu or cuda; transformers runs there too")
    p.add_argument("--dtype", default="auto", help="engine.dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig().max_num_batched_tokens)
    p.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=EngineConfig().max_prefill_tokens_while_decoding,
        help="engine.max_prefill_tokens_while_decoding (0: auto)",
    )
    p.add_argument("--no-kernel", action="store_true", help="PyTorch ops only (engine.native_kernels = false)")
    p.add_argument("--kernel-isa", default="auto", help="engine.kernel_isa: auto, avx512, avx2 or torch")
    p.add_argument("--quantization", default="none", help="engine.quantization: none or int8")
    p.add_argument("--cuda-graphs", default="auto", help="engine.cuda_graphs: auto, off or eager")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--engine-only", action="store_true", help="skip the transformers baselines and the HTTP path")
    p.add_argument("--skip-generate-batch", action="store_true", help="skip transformers' generate_batch")
    p.add_argument("--json", type=Path, help="also write the JSON line to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    sections = set(args.sections.split(","))
    if unknown := sections - set(SECTIONS):
        raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.engine_only:
        sections -= {"transformers", "http"}
    model_dir = in_own_thread(build_reference_model, args.model_dir)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, torch.float32)
    peak = in_own_thread(lambda: measure_matmul_peak_gflops(device=device, dtype=dtype))
    direct = asyncio.run(bench_engine(model_dir, plan, args, peak, sections))
    engine = direct.get("engine", [])
    restart = (
        asyncio.run(restart_ttft(model_dir, engine_config(args), system_len=plan.system_prompt_len, repeats=2))
        if "restart" in sections
        else None
    )
    if restart is not None:
        print_restart(restart)
    http = asyncio.run(bench_http(model_dir, plan, args, peak)) if "http" in sections else []
    hf = (
        bench_transformers(model_dir, plan, peak, args.skip_generate_batch, device, dtype)
        if "transformers" in sections
        else []
    )
    itl, prefix = direct.get("chunked_prefill"), direct.get("prefix_cache")
    summary = checks(engine, http, hf, itl, prefix)
    machine = machine_info(peak, device, dtype)
    print_report(engine + http + hf, itl, prefix, summary, machine)
    if direct.get("structured") is not None:
        print_structured(direct["structured"])
    cfg = engine_config(args)
    record = {
        "machine": machine,
        "plan": asdict(plan),
        "engine_config": {
            k: getattr(cfg, k)
            for k in (
                "max_num_batched_tokens",
                "max_prefill_tokens_while_decoding",
                "max_num_seqs",
                "block_size",
                "native_kernels",
                "kernel_isa",
                "quantization",
                "cuda_graphs",
            )
        },
        "engine": [asdict(r) for r in engine],
        "http": [asdict(r) for r in http],
        "baselines": [asdict(r) for r in hf],
        "chunked_prefill": itl,
        "prefix_cache": prefix,
        "prefix_cache_restart": restart,
        "structured": direct.get("structured"),
        "summary": summary,
    }
    line = json.dumps(record, default=float)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return record


if __name__ == "__main__":
    main()
