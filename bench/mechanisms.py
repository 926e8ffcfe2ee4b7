"""The engine bench's mechanism tests on a running NativeBackend: decode ITL while a long prompt
is chunk-prefilled, TTFT behind a cached system prompt (cold vs warm), and the first TTFT after
a restart with and without the prefix cache kept on disk. Returns dicts; prints nothing.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from bench.workload import BenchRequest, backend_generate, make_requests, pct
from engine.native.backend import NativeBackend
from engine.tokenizer import Tokenizer
from settings import EngineConfig


async def chunked_prefill_itl(backend: NativeBackend, *, num_streams: int, long_prompt_len: int) -> dict:
    """While `num_streams` decode, a long prompt arrives: their ITL during its prefill vs median."""
    generate = backend_generate(backend)
    streams = make_requests(num_streams, 128, 2048, seed=11, prefix="itl")  # they run until cancelled
    gaps: list[tuple[float, float]] = []  # (previous token time, this token time)
    warm = asyncio.Event()
    done = asyncio.Event()
    num_warm = 0

    async def stream(req: BenchRequest) -> None:
        nonlocal num_warm
        last, count = None, 0
        async for _ in generate(req):
            now = time.perf_counter()
            if last is not None:
                gaps.append((last, now))
            last, count = now, count + 1
            if count == 16:
                num_warm += 1
                if num_warm == num_streams:
                    warm.set()
            if done.is_set() and count > 16:
                return

    tasks = [asyncio.create_task(stream(r)) for r in streams]
    await asyncio.wait_for(warm.wait(), timeout=120)
    await asyncio.sleep(0.5)  # a stretch of pure decoding for the median
    long_req = make_requests(1, long_prompt_len, 1, seed=12, prefix="long")[0]
    arrived = time.perf_counter()
    async for _ in generate(long_req):
        pass
    prefilled = time.perf_counter()
    await asyncio.sleep(0.5)
    done.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    all_ms = [(b - a) * 1e3 for a, b in gaps]
    during_ms = [(b - a) * 1e3 for a, b in gaps if b > arrived and a < prefilled]
    median = statistics.median(all_ms)
    p99 = pct(during_ms, 99)
    return {
        "streams": num_streams,
        "long_prompt_tokens": long_prompt_len,
        "prefill_ms": (prefilled - arrived) * 1e3,
        "itl_ms_median": median,
        "itl_ms_p50_during_prefill": pct(during_ms, 50),
        "itl_ms_p99_during_prefill": p99,
        "itl_ms_max_during_prefill": max(during_ms),
        "ratio": p99 / median,
        "target_ratio_below": 3.0,
    }


async def prefix_cache_ttft(backend: NativeBackend, *, system_len: int, repeats: int) -> dict:
    """TTFT of a prompt behind a shared system prompt, cold (first sight) vs warm (cached)."""
    generate = backend_generate(backend)

    async def ttft(req: BenchRequest) -> float:
        start = time.perf_counter()
        async for _ in generate(req):
            return (time.perf_counter() - start) * 1e3
        raise RuntimeError("no token")

    cold, warm = [], []
    for i in range(repeats):
        system = make_requests(1, system_len, 1, seed=100 + i, prefix="sys")[0].prompt_token_ids
        user = [make_requests(1, 32, 1, seed=200 + 10 * i + j)[0].prompt_token_ids for j in range(2)]
        cold.append(await ttft(BenchRequest(f"cold{i}", system + user[0], 1)))
        warm.append(await ttft(BenchRequest(f"warm{i}", system + user[1], 1)))
    return {
        "system_prompt_tokens": system_len,
        "ttft_ms_cold": statistics.median(cold),
        "ttft_ms_warm": statistics.median(warm),
        "ratio": statistics.median(warm) / statistics.median(cold),
        "target_ratio_at_most": 0.2,
    }


async def restart_ttft(model_dir: Path, config: EngineConfig, *, system_len: int, repeats: int) -> dict:
    """TTFT of the first request after a restart, behind a system prompt the last process saw:
    with the prefix cache kept across restarts (engine.prefix_cache_dir) and without it, each
    against the same prompt arriving cold; and the seconds the stop spent writing the cache."""
    import tempfile

    tokenizer = Tokenizer.from_dir(model_dir)
    system = make_requests(1, system_len, 1, seed=300, prefix="sys")[0].prompt_token_ids

    async def first_ttft(backend: NativeBackend, request_id: str, user_seed: int) -> float:
        user = make_requests(1, 32, 1, seed=user_seed)[0].prompt_token_ids
        start = time.perf_counter()
        async for _ in backend_generate(backend)(BenchRequest(request_id, system + user, 1)):
            return (time.perf_counter() - start) * 1e3
        raise RuntimeError("no token")

    out: dict = {"system_prompt_tokens": system_len}
    with tempfile.TemporaryDirectory() as tmp:
        for kept in (True, False):
            cold, after, save_s = [], [], []
            for i in range(repeats):
                directory = Path(tmp) / f"{kept}-{i}" if kept else None
                backend = NativeBackend(model_dir, config, tokenizer, prefix_cache_dir=directory)
                await backend.start()
                cold.append(await first_ttft(backend, "cold", 400 + i))
                stop_start = time.perf_counter()
                await backend.shutdown()
                save_s.append(time.perf_counter() - stop_start)
                backend = NativeBackend(model_dir, config, tokenizer, prefix_cache_dir=directory)
                await backend.start()
                after.append(await first_ttft(backend, "after", 500 + i))
                await backend.shutdown()
            name = "kept" if kept else "not_kept"
            out[f"ttft_ms_cold_{name}"] = statistics.median(cold)
            out[f"ttft_ms_after_restart_{name}"] = statistics.median(after)
            out[f"stop_s_{name}"] = statistics.median(save_s)
    out["ratio_after_restart_kept_vs_not"] = out["ttft_ms_after_restart_kept"] / out["ttft_ms_after_restart_not_kept"]
    return out
