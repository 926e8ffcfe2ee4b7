"""The engine bench's shared workload: the 30M reference model and its tokenizer, the requests
(random ids or chat prompts of an exact length), the plan, the FLOP count, and the closed loop
that drives one path (engine or HTTP) and times it. Other benches build on these; this module
prints nothing and knows no peer.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from engine.native.backend import NativeBackend
from engine.tokenizer import Tokenizer
from engine.types import GenerationRequest, SamplingParams

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


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100); NaN when there are no values."""
    return float(np.percentile(values, q)) if values else float("nan")


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


def with_fraction(r: LoadResult, flops: float, peak_gflops: float) -> LoadResult:
    """The result with its compute fraction: `flops` over its wall time, of the matmul peak."""
    return LoadResult(**{**asdict(r), "compute_fraction": flops / r.wall_s / (peak_gflops * 1e9)})


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


def load_requests(tokenizer: Tokenizer, plan: Plan, concurrency: int) -> list[BenchRequest]:
    """The load at one concurrency: the same prompts for the engine and the HTTP path."""
    return make_chat_requests(
        tokenizer, plan.num_requests, plan.prompt_len, plan.output_len, seed=concurrency, prefix=f"c{concurrency}-"
    )


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
        pct(ttfts, 50),
        pct(ttfts, 99),
        pct(itls, 50),
        pct(itls, 99),
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
