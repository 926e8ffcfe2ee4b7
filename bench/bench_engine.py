"""Engine benchmark (`make bench`): the native engine against transformers on one machine, one run.

Reference model: Llama, vocab 8192, hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate
1408, tied embeddings, random weights (seed 0), fp32. Prints one table and one JSON line:
throughput, TTFT and inter-token latency per concurrency; transformers baselines (on the
engine's device, in its dtype: `--device cuda` runs both on a GPU); the fraction of the
measured matmul peak; the chunked-prefill ITL test and the prefix-cache TTFT test.
Other paths (the HTTP server) plug in through `run_load(generate, requests, concurrency)`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/bench_engine.py` as well as `python -m bench.bench_engine`

from bench.bench_structured import print_structured, structured_overhead  # noqa: E402
from engine.native.backend import NativeBackend  # noqa: E402
from engine.native.runner import resolve_device, resolve_dtype  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from settings import EngineConfig  # noqa: E402

REFERENCE = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1408,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
NEVER_EOS = 10**9  # an id past the vocabulary: transformers runs to max_new_tokens


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]  # what the engine sees (the rendered chat prompt for chat requests)
    max_tokens: int  # generated exactly (EOS ignored)
    user_text: str | None = None  # chat requests: the user message that renders to prompt_token_ids


# A path under test: takes a request, yields the number of new tokens in each chunk received.
GenerateFn = Callable[[BenchRequest], AsyncIterator[int]]


@dataclass(frozen=True, slots=True)
class LoadResult:
    name: str
    concurrency: int
    num_requests: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    compute_fraction: float = 0.0  # of the measured matmul peak, prompt and generated tokens counted

    @classmethod
    def throughput_only(cls, name: str, concurrency: int, num_requests: int, wall_s: float, num_out: int) -> LoadResult:
        """A peer's run that reports no per-token timings (NaN latencies)."""
        nan = float("nan")
        return cls(name, concurrency, num_requests, wall_s, 0, num_out, num_out / wall_s, nan, nan, nan, nan)


def train_bench_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer in which every one of the `vocab_size` ids but the specials
    decodes to ASCII text, trained on the ASCII of this Python's standard library sources: the
    random model's tokens then stream as text through the HTTP server, as a real model's do."""
    import sysconfig

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from testing.tiny_model import SPECIAL_TOKENS

    texts, size = [], 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = source.read_text(encoding="utf-8", errors="ignore").encode("ascii", "ignore").decode()
        texts.append(text)
        size += len(text)
        if size > 4_000_000:
            break
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the bench tokenizer has {tok.get_vocab_size()} ids, not {vocab_size}")
    return tok


def build_reference_model(path: Path) -> Path:
    """Write the reference checkpoint (and a tokenizer so a server can load it) once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from testing.tiny_model import write_tokenizer_files

    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    eos_id = write_tokenizer_files(path, train_bench_tokenizer(REFERENCE["vocab_size"]))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**REFERENCE, eos_token_id=eos_id, pad_token_id=0, bos_token_id=None))
    model.to(torch.float32).save_pretrained(path)
    return path


def make_requests(n: int, prompt_len: int, max_tokens: int, seed: int, prefix: str = "r") -> list[BenchRequest]:
    rng = random.Random(seed)
    vocab = REFERENCE["vocab_size"]
    return [
        BenchRequest(f"{prefix}{i}", tuple(rng.randrange(3, vocab) for _ in range(prompt_len)), max_tokens)
        for i in range(n)
    ]


def make_chat_requests(
    tokenizer: Tokenizer, n: int, prompt_len: int, max_tokens: int, seed: int, prefix: str = "r"
) -> list[BenchRequest]:
    """Requests whose one user message renders (chat template included) to exactly `prompt_len`
    tokens: the same prompts go to the engine as ids, to transformers, and to the HTTP server."""
    rng = random.Random(seed)
    words = sorted(
        {w for i in range(tokenizer.vocab_size) if (w := tokenizer.decode([i]).strip()).isascii() and w.isalpha()}
    )

    def rendered(ws: list[str]) -> list[int]:
        return tokenizer.encode_chat([{"role": "user", "content": " ".join(ws)}])

    out = []
    for i in range(n):
        ws: list[str] = []
        while len(ids := rendered(ws)) < prompt_len:
            ws.append(rng.choice(words))
        for _ in range(200):  # overshot: swap the last word until the length is exact
            if len(ids) == prompt_len:
                break
            ws[-1] = rng.choice(words)
            ids = rendered(ws)
        if len(ids) != prompt_len:
            raise RuntimeError(f"could not build a {prompt_len}-token chat prompt")
        out.append(BenchRequest(f"{prefix}{i}", tuple(ids), max_tokens, " ".join(ws)))
    return out


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def run_load(name: str, generate: GenerateFn, requests: list[BenchRequest], concurrency: int) -> LoadResult:
    """Closed loop: `concurrency` clients, each sending its next request when one finishes."""
    pending = list(requests)
    ttfts: list[float] = []
    itls: list[float] = []
    num_out = 0

    async def client() -> None:
        nonlocal num_out
        while pending:
            req = pending.pop(0)
            sent = last = time.perf_counter()
            first = True
            async for n in generate(req):
                if not n:  # e.g. the HTTP role chunk: no token yet
                    continue
                now = time.perf_counter()
                if first:
                    ttfts.append((now - sent) * 1e3)
                    first = False
                else:
                    itls.extend([(now - last) * 1e3 / n] * n)
                last = now
                num_out += n

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return LoadResult(
        name,
        concurrency,
        len(requests),
        wall,
        sum(len(r.prompt_token_ids) for r in requests),
        num_out,
        num_out / wall,
        _pct(ttfts, 50),
        _pct(ttfts, 99),
        _pct(itls, 50),
        _pct(itls, 99),
    )


def backend_generate(backend: NativeBackend) -> GenerateFn:
    async def generate(req: BenchRequest) -> AsyncIterator[int]:
        sampling = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        async for event in backend.generate(GenerationRequest(req.request_id, req.prompt_token_ids, sampling)):
            yield len(event.token_ids)

    return generate


def http_generate(session, base_url: str, model: str) -> GenerateFn:
    """A real streaming client: POST /v1/chat/completions, read SSE, count tokens per chunk
    from `usage.completion_tokens` (stream_options.continuous_usage_stats)."""
    import orjson

    async def generate(req: BenchRequest) -> AsyncIterator[int]:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": req.user_text}],
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        seen = 0
        async with session.post(f"{base_url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                usage = orjson.loads(line[6:]).get("usage")
                if usage is None:
                    continue
                if usage["prompt_tokens"] != len(req.prompt_token_ids):
                    raise RuntimeError(
                        f"prompt rendered to {usage['prompt_tokens']} tokens, expected {len(req.prompt_token_ids)}"
                    )
                new, seen = usage["completion_tokens"] - seen, usage["completion_tokens"]
                yield new
        if seen != req.max_tokens:
            raise RuntimeError(f"{req.request_id}: {seen} tokens, expected {req.max_tokens}")

    return generate


def in_own_thread(fn, *args):
    """Run torch work in a thread that then exits. A thread that ran multi-threaded torch ops
    keeps an OpenMP pool while it lives, and two live pools on a small machine slow every op of
    the engine's step thread (see NativeBackend.start), so the main thread stays torch-free."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    thread.join()
    if not result:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed; see the traceback above")
    return result[0]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a timer reads its end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak_gflops(
    n: int = 2048, repeats: int = 5, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> float:
    """The best square matmul rate in this dtype on this device (8192 on a GPU, where 2048 is too small to fill it)."""
    device = device or torch.device("cpu")
    n = 8192 if device.type == "cuda" else n
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def workload_flops(prompt_len: int, output_len: int, num_requests: int) -> float:
    """FLOPs of every processed token: 2 x matmul parameters plus attention over its context."""
    r = REFERENCE
    h, layers, heads = r["hidden_size"], r["num_hidden_layers"], r["num_attention_heads"]
    head_dim = h // heads
    kv = r["num_key_value_heads"] * head_dim
    params = layers * (h * (h + 2 * kv) + h * h + 3 * h * r["intermediate_size"]) + r["vocab_size"] * h
    contexts = np.arange(1, prompt_len + output_len)  # the last sampled token is never fed back
    per_request = 2 * params * len(contexts) + 4 * layers * heads * head_dim * contexts.sum()
    return float(per_request * num_requests)


# -- transformers baselines ------------------------------------------------------------------


def _hf_config(model, max_tokens: int):
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.min_new_tokens, config.do_sample = max_tokens, None, False
    config.eos_token_id, config.pad_token_id = NEVER_EOS, 0
    return config


@torch.inference_mode()
def hf_one_at_a_time(model, requests: list[BenchRequest]) -> LoadResult:
    ttfts, num_out = [], 0
    start = time.perf_counter()
    for req in requests:
        ids = torch.tensor([req.prompt_token_ids], device=model.device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_hf_config(model, 1))
        synchronize(model.device)
        ttfts.append((time.perf_counter() - t0) * 1e3)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=_hf_config(model, req.max_tokens)
        )
        num_out += out.shape[1] - ids.shape[1]
    synchronize(model.device)
    # TTFT runs are separate prefills; subtract them from the wall time of the generation runs.
    wall = time.perf_counter() - start - sum(ttfts) / 1e3
    return LoadResult(
        "transformers one-at-a-time",
        1,
        len(requests),
        wall,
        0,
        num_out,
        num_out / wall,
        _pct(ttfts, 50),
        _pct(ttfts, 99),
        float("nan"),
        float("nan"),
    )


@torch.inference_mode()
def hf_static_batch(model, requests: list[BenchRequest], batch_size: int) -> LoadResult:
    num_out = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        # Equal lengths: no padding.
        ids = torch.tensor([r.prompt_token_ids for r in requests[i : i + batch_size]], device=model.device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=_hf_config(model, requests[i].max_tokens)
        )
        num_out += out[:, ids.shape[1] :].numel()
    synchronize(model.device)
    wall = time.perf_counter() - start
    return LoadResult.throughput_only(
        f"transformers static batch {batch_size}", batch_size, len(requests), wall, num_out
    )


@torch.no_grad()  # not inference_mode: transformers' continuous batching updates its tensors in place
def hf_generate_batch(model, requests: list[BenchRequest]) -> LoadResult | None:
    if not hasattr(model, "generate_batch"):
        return None
    # Its first call sets up the paged cache and takes seconds: warm it up like the others.
    model.generate_batch(inputs=[list(requests[0].prompt_token_ids)], generation_config=_hf_config(model, 4))
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=[list(r.prompt_token_ids) for r in requests], generation_config=_hf_config(model, requests[0].max_tokens)
    )
    wall = time.perf_counter() - start
    num_out = sum(len(o.generated_tokens) for o in outputs.values())
    return LoadResult.throughput_only("transformers generate_batch", len(requests), len(requests), wall, num_out)


# -- mechanism tests -------------------------------------------------------------------------


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
    p99 = _pct(during_ms, 99)
    return {
        "streams": num_streams,
        "long_prompt_tokens": long_prompt_len,
        "prefill_ms": (prefilled - arrived) * 1e3,
        "itl_ms_median": median,
        "itl_ms_p50_during_prefill": _pct(during_ms, 50),
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


def print_restart(r: dict) -> None:
    print(
        f"\nfirst request after a restart, behind a {r['system_prompt_tokens']}-token system prompt the last "
        f"process saw (medians):\n  prefix cache kept: TTFT {r['ttft_ms_after_restart_kept']:.0f} ms "
        f"(cold {r['ttft_ms_cold_kept']:.0f} ms; the stop took {r['stop_s_kept']:.2f} s)\n"
        f"  not kept:          TTFT {r['ttft_ms_after_restart_not_kept']:.0f} ms "
        f"(cold {r['ttft_ms_cold_not_kept']:.0f} ms; the stop took {r['stop_s_not_kept']:.2f} s)\n"
        f"  ratio kept / not kept: {r['ratio_after_restart_kept_vs_not']:.2f}"
    )


# -- driver ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    num_requests: int
    prompt_len: int
    output_len: int
    concurrencies: tuple[int, ...]
    hf_one_at_a_time_requests: int
    hf_static_requests: int
    hf_generate_batch_requests: int
    long_prompt_len: int
    system_prompt_len: int


FULL = Plan(64, 128, 128, (1, 8, 32, 64), 6, 64, 8, 2048, 1024)
QUICK = Plan(16, 128, 32, (1, 8, 16), 2, 16, 4, 1024, 1024)
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


def load_requests(tokenizer: Tokenizer, plan: Plan, concurrency: int) -> list[BenchRequest]:
    """The load at one concurrency: the same prompts for the engine and the HTTP path."""
    return make_chat_requests(
        tokenizer, plan.num_requests, plan.prompt_len, plan.output_len, seed=concurrency, prefix=f"c{concurrency}-"
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
            _with_fraction(await run_load(name, generate, load_requests(tokenizer, plan, c), c), flops, peak_gflops)
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


def _with_fraction(r: LoadResult, flops: float, peak_gflops: float) -> LoadResult:
    return LoadResult(**{**asdict(r), "compute_fraction": flops / r.wall_s / (peak_gflops * 1e9)})


def bench_transformers(
    model_dir: Path, plan: Plan, peak_gflops: float, skip_generate_batch: bool, device: torch.device, dtype: torch.dtype
) -> list[LoadResult]:
    """transformers on the engine's device, in the engine's dtype."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tokenizer = Tokenizer.from_dir(model_dir)
    reqs = make_chat_requests(
        tokenizer, max(plan.hf_static_requests, 32), plan.prompt_len, plan.output_len, seed=32, prefix="hf"
    )
    one = hf_one_at_a_time(model, reqs[: plan.hf_one_at_a_time_requests])
    batch = min(32, plan.hf_static_requests)
    static = hf_static_batch(model, reqs[: plan.hf_static_requests], batch)
    flops = workload_flops(plan.prompt_len, plan.output_len, plan.hf_static_requests)
    results = [_with_fraction(one, workload_flops(plan.prompt_len, plan.output_len, one.num_requests), peak_gflops)]
    results.append(_with_fraction(static, flops, peak_gflops))
    if not skip_generate_batch:
        cb = hf_generate_batch(model, reqs[: plan.hf_generate_batch_requests])
        if cb is not None:
            results.append(
                _with_fraction(cb, workload_flops(plan.prompt_len, plan.output_len, cb.num_requests), peak_gflops)
            )
    return results


def checks(
    engine: list[LoadResult], http: list[LoadResult], hf: list[LoadResult], itl: dict | None, prefix: dict | None
) -> dict:
    """Each target that this run has the figures for: its ratio and whether it passed."""
    ratios: dict[str, float] = {}
    passed: dict[str, bool] = {}
    by_c = {r.concurrency: r for r in engine}
    one = next((r for r in hf if "one-at-a-time" in r.name), None)
    static = next((r for r in hf if "static" in r.name), None)
    top = by_c.get(32) or (engine[-1] if engine else None)
    if top is not None and static is not None:
        ratios["conc32_vs_static_batch"] = top.output_tokens_per_s / static.output_tokens_per_s
        passed["conc32_ge_1.5x_static"] = ratios["conc32_vs_static_batch"] >= 1.5
    if top is not None:
        ratios["conc32_compute_fraction"] = top.compute_fraction
        passed["conc32_ge_35pct_compute"] = top.compute_fraction >= 0.35
    if 1 in by_c and one is not None:
        ratios["conc1_vs_one_at_a_time"] = by_c[1].output_tokens_per_s / one.output_tokens_per_s
        passed["conc1_ge_2x_one_at_a_time"] = ratios["conc1_vs_one_at_a_time"] >= 2.0
    for h in http:
        if h.concurrency in by_c:
            ratio = h.output_tokens_per_s / by_c[h.concurrency].output_tokens_per_s
            ratios[f"http_vs_engine_conc{h.concurrency}"] = ratio
            passed[f"http_within_15pct_conc{h.concurrency}"] = ratio >= 0.85
    if itl is not None:
        passed["chunked_prefill_p99_lt_3x_median"] = itl["ratio"] < 3.0
    if prefix is not None:
        passed["prefix_warm_le_one_fifth_cold"] = prefix["ratio"] <= 0.2
    return {"ratios": ratios, "pass": passed}


def print_report(rows: list[LoadResult], itl: dict | None, prefix: dict | None, summary: dict, machine: dict) -> None:
    peak = f"{machine['dtype']} matmul peak {machine['peak_gflops']:.0f} GFLOP/s"
    where = f"{machine['gpu']} ({machine['device']})" if "gpu" in machine else f"{machine['threads']} threads"
    print(f"machine: {machine['cpu']} | {where} | {peak}")
    header = (
        f"{'path':34} {'conc':>5} {'reqs':>5} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'compute':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.name:34} {r.concurrency:>5} {r.num_requests:>5} {r.output_tokens_per_s:>10.1f} {r.ttft_ms_p50:>9.1f} "
            f"{r.ttft_ms_p99:>9.1f} {r.itl_ms_p50:>8.1f} {r.itl_ms_p99:>8.1f} {r.compute_fraction:>7.1%}"
        )
    if itl is not None:
        print(
            f"chunked prefill: {itl['long_prompt_tokens']}-token prompt over {itl['streams']} streams: "
            "ITL during prefill "
            f"p50 {itl['itl_ms_p50_during_prefill']:.1f} / p99 {itl['itl_ms_p99_during_prefill']:.1f} / max "
            f"{itl['itl_ms_max_during_prefill']:.1f} ms vs median {itl['itl_ms_median']:.1f} ms: "
            f"p99 = {itl['ratio']:.2f}x (< 3x); "
            f"prefill took {itl['prefill_ms']:.0f} ms"
        )
    if prefix is not None:
        print(
            f"prefix cache: {prefix['system_prompt_tokens']}-token system prompt: "
            f"TTFT warm {prefix['ttft_ms_warm']:.1f} ms "
            f"vs cold {prefix['ttft_ms_cold']:.1f} ms = {prefix['ratio']:.3f} (<= 0.2)"
        )
    for name, value in summary["ratios"].items():
        print(f"  {name}: {value:.3f}")
    if summary["pass"] and machine.get("device", "cpu") != "cpu":
        print("  (the targets below were set for the 2-core CPU; on a GPU they only describe the run)")
    for name, ok in summary["pass"].items():
        print(f"  {'PASS' if ok else 'FAIL'} {name}")


def machine_info(peak: float, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "peak_gflops": peak}
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return {**info, "device": str(device or "cpu"), "dtype": str(dtype).removeprefix("torch.")}


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
