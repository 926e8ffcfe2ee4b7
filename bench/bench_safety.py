"""The safety gate's cost over HTTP (part of `make bench`, issue #22): `server.py` with the
default configuration (safety on) against the same server with `safety.enabled = false`, one run.

Two workloads on the reference model's shape (bench/workload.py's REFERENCE, random weights) with the
bundled demo model's English tokenizer (vocabulary 4,096, so 28M parameters): random tokens of
it read as English word salad, which the output classifier lets through, where the code-like
text of bench_engine's tokenizer gets about 40% of the answers blocked as malware (a fair
measure of the gate's cost needs answers it passes; blocked ones are still counted):
- throughput: 32 streaming clients in a closed loop, 128-token prompts, 64 tokens out each;
- warm TTFT: a 1,000-token system prompt, then requests behind it with a new short user
  message each (the system prompt is in the engine's prefix cache, the user message is new).
Also `transformers`' static batch of 32 on the same prompts (the issue's table form). Servers
alternate (off, on, off, on, ...) so slow drift of a shared machine hits both; `--variants`
adds others from VARIANTS below (the classifier in int8, float32 or bfloat16 instead of the
default, the prompt screen without the answer check, the rules alone). Prints a table,
the targets (safety on >= 90% of off at 32 streams; warm TTFT on <= 1.3x off) and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import in_own_thread, machine_info  # noqa: E402
from bench.transformers_peer import hf_static_batch  # noqa: E402
from bench.workload import REFERENCE, make_chat_requests  # noqa: E402
from engine.native.kernels import cpu_flags, supported_modes  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

TARGET_THROUGHPUT_RATIO = 0.9  # safety on / off at 32 streams, at least
TARGET_TTFT_RATIO = 1.3  # safety on / off, warm request behind the system prompt, at most
SERVER_SETTINGS = {
    "server.log_level": "warning",
    "engine.max_num_seqs": 64,
    "engine.kv_cache_bytes": 1 << 30,
    "tiers.enterprise.max_concurrent_streams": 1000,  # keyless loopback requests are enterprise
    "tiers.enterprise.requests_per_minute": 100_000,
    "tiers.enterprise.tokens_per_minute": 100_000_000,
    # The closed loop's 32 streams arrive at once; the queue's wait estimate must not shed them
    # (it measured 61 s on the first burst): this bench measures the gate, not load shedding.
    "queue.max_wait_s": 3600,
}


DEMO_TOKENIZER = ROOT / "models" / "demo-flagship"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


SHAPES = ("reference", "qwen-390m")


def build_model(path: Path, shape: str = "reference") -> Path:
    """REFERENCE's shape (or, with `shape="qwen-390m"`, bench_peers' 390M model of Qwen2.5-0.5B's
    shape) with the demo model's tokenizer and vocabulary size, random weights."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from bench.bench_peers import QWEN_390M

    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_TOKENIZER / name, path / name)
    tokenizer = Tokenizer.from_dir(path)
    torch.manual_seed(0)
    eos_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    config_cls, model_cls, dims = (
        (LlamaConfig, LlamaForCausalLM, REFERENCE)
        if shape == "reference"
        else (Qwen2Config, Qwen2ForCausalLM, QWEN_390M)
    )
    config = config_cls(
        **{**dims, "vocab_size": tokenizer.vocab_size}, pad_token_id=0, bos_token_id=None, eos_token_id=eos_id
    )
    model_cls(config).to(torch.float32).save_pretrained(path)
    return path


@dataclass(frozen=True, slots=True)
class StreamResult:
    ttft_s: float | None  # first content token, from the request
    num_tokens: int
    finish_reason: str | None


# Server configurations compared: name -> settings over SERVER_SETTINGS.
VARIANTS = {
    "off": {"safety.enabled": "false"},
    "on": {"safety.enabled": "true"},  # the default configuration (embed_dtype auto: w8a8 with VNNI, see embedder)
    "on-int8": {"safety.enabled": "true", "safety.embed_dtype": "int8"},  # int8 weights, float32 activations
    "on-f32": {"safety.enabled": "true", "safety.embed_dtype": "float32"},  # the classifier's weights in fp32
    "on-bf16": {"safety.enabled": "true", "safety.embed_dtype": "bfloat16"},  # the classifier's matmuls in bf16
    "on-w8a8": {"safety.enabled": "true", "safety.embed_dtype": "w8a8"},  # int8 weights and activations
    "on-noout": {"safety.enabled": "true", "safety.output_classifier": "false"},  # prompts screened, answers by rules
    "on-rules": {"safety.enabled": "true", "safety.classifier": "false"},  # the rules alone
    # The classifier's threads where no native CPU engine runs (a GPU engine, --fake-engine): one, or two.
    "on-t1": {"safety.enabled": "true", "safety.threads": "1"},
    "on-t2": {"safety.enabled": "true", "safety.threads": "2"},
}


@dataclass(frozen=True, slots=True)
class RoundResult:
    variant: str
    round: int
    tokens_per_s: float  # 32-stream closed loop, output tokens / wall time
    num_filtered: int  # streams that ended with content_filter (prompt refused or answer cut)
    ttft_ms_warm: float  # median over the warm requests
    ttft_ms_cold: float  # the first request behind the system prompt


async def stream_chat(session, url: str, body: dict) -> StreamResult:
    """One streaming request; counts tokens from `usage` (continuous_usage_stats)."""
    import orjson

    sent = time.perf_counter()
    ttft, tokens, finish = None, 0, None
    payload = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with session.post(url, json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices", ()):
                if choice.get("delta", {}).get("content") and ttft is None:
                    ttft = time.perf_counter() - sent
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return StreamResult(ttft, tokens, finish)


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def closed_loop(session, url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int):
    """(output tokens per second, streams ended by content_filter)."""
    pending = list(prompts)
    results: list[StreamResult] = []

    async def client() -> None:
        while pending:
            text = pending.pop(0)
            body = chat_body(model, [{"role": "user", "content": text}], max_tokens)
            results.append(await stream_chat(session, url, body))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return sum(r.num_tokens for r in results) / wall, sum(r.finish_reason == "content_filter" for r in results)


def system_prompt(tokenizer: Tokenizer, num_tokens: int, seed: int) -> str:
    """Words of the bench vocabulary until the system message alone renders to `num_tokens`."""
    rng = random.Random(seed)
    decoded = (tokenizer.decode([i]).strip() for i in range(tokenizer.vocab_size))
    words = sorted({w for w in decoded if w.isascii() and w.isalpha()})
    text: list[str] = []
    while len(tokenizer.encode_chat([{"role": "system", "content": " ".join(text)}])) < num_tokens:
        text.extend(rng.choice(words) for _ in range(16))
    return " ".join(text)


async def warm_ttft(session, url: str, model: str, system: str, questions: list[str]) -> tuple[float, float]:
    """(cold TTFT, median warm TTFT) in ms: the first request puts the system prompt in the
    prefix cache; each later one has a new user message behind it."""
    ttfts = []
    for question in questions:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        result = await stream_chat(session, url, chat_body(model, messages, 4))
        if result.ttft_s is None:
            raise RuntimeError(f"no content token (finish_reason {result.finish_reason})")
        ttfts.append(result.ttft_s * 1e3)
    return ttfts[0], statistics.median(ttfts[1:])


async def one_round(model_dir: Path, variant: str, round_no: int, args, prompts: list[str], ttft_inputs) -> RoundResult:
    settings = {**SERVER_SETTINGS, **dict(kv.split("=", 1) for kv in args.set), **VARIANTS[variant]}
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--model", str(model_dir), "--db", str(Path(tmp) / "bench.db")]
        for key, value in settings.items():
            argv += ["--set", f"{key}={value}"]
        log_dir = args.server_log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"server-{variant}-{round_no}.log"
        try:
            return await serve_round(argv, log_path, variant, round_no, args, prompts, ttft_inputs)
        except BaseException:  # a failed or interrupted round shows what its server said last
            print(f"round {variant} {round_no} failed; the end of {log_path}:", flush=True)
            if log_path.exists():
                print("\n".join(log_path.read_text(errors="replace").splitlines()[-40:]), flush=True)
            raise


async def serve_round(argv, log_path: Path, variant: str, round_no: int, args, prompts, ttft_inputs) -> RoundResult:
    import aiohttp

    from testing.server_proc import ServerProcess

    system, questions = ttft_inputs
    fake = None
    if args.fake_engine:
        from testing.fake_backend import FakeBehaviour

        fake = FakeBehaviour()  # answers at once, on no CPU pool: what the gate sees beside a GPU engine
    with ServerProcess(argv, log_path=log_path, fake=fake) as server:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            url = f"{server.base_url}/v1/chat/completions"
            async with session.get(f"{server.base_url}/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            await closed_loop(session, url, model, prompts[:8], 8, 8)  # warm-up
            tok_s, filtered = await closed_loop(session, url, model, prompts, args.concurrency, args.output_len)
            cold, warm = await warm_ttft(session, url, model, system, questions)
    return RoundResult(variant, round_no, tok_s, filtered, warm, cold)


def summarize(rounds: list[RoundResult]) -> dict:
    """Medians per variant, and each safety variant's ratios to "off" with the targets."""

    def med(variant: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in rounds if r.variant == variant)

    variants = list(dict.fromkeys(r.variant for r in rounds))
    out: dict = {
        "median": {
            v: {"tokens_per_s": med(v, "tokens_per_s"), "ttft_ms_warm": med(v, "ttft_ms_warm")} for v in variants
        }
    }
    off = out["median"]["off"]
    for v in variants:
        if v == "off":
            continue
        tok = out["median"][v]["tokens_per_s"] / off["tokens_per_s"]
        ttft = out["median"][v]["ttft_ms_warm"] / off["ttft_ms_warm"]
        out[v] = {
            "throughput_ratio": tok,
            "ttft_ratio": ttft,
            "pass": {
                f"throughput_ge_{TARGET_THROUGHPUT_RATIO}x_off": tok >= TARGET_THROUGHPUT_RATIO,
                f"warm_ttft_le_{TARGET_TTFT_RATIO}x_off": ttft <= TARGET_TTFT_RATIO,
            },
        }
    return out


def path_note(machine: dict) -> str:
    """Which kernel path the servers ran: settings given with --set, oneDNN's cap, VNNI."""
    chosen = machine.get("settings", {})
    return (
        f"engine.kernel_isa={chosen.get('engine.kernel_isa', 'auto')}, "
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}, "
        f"CPU flags avx512_vnni: {'avx512_vnni' in cpu_flags()}, avx_vnni: {'avx_vnni' in cpu_flags()} (the gate's "
        "int8 matmul uses the one of its kernels' width)"
    )


def print_report(
    rounds: list[RoundResult], summary: dict, hf_tok_s: float | None, machine: dict, concurrency: int = 32
) -> None:
    isa = ", ".join(m.value for m in supported_modes()) or "no x86 kernels"
    gpu = f" | engine on {machine['gpu']}" if machine.get("gpu") else ""
    print(f"machine: {machine['cpu']}{gpu} | kernels this CPU runs: {isa} | {machine['threads']} torch threads")
    print(f"paths: {path_note(machine)}")
    print(
        f"{'server':8} {'round':>5} {f'{concurrency} streams tok/s':>17} {'filtered':>9} {'TTFT warm ms':>13} "
        f"{'TTFT cold ms':>13}"
    )
    for r in rounds:
        print(
            f"{r.variant:8} {r.round:>5} {r.tokens_per_s:>17.1f} {r.num_filtered:>9} {r.ttft_ms_warm:>13.1f} "
            f"{r.ttft_ms_cold:>13.1f}"
        )
    for variant, m in summary["median"].items():
        line = f"median {variant:8}: {m['tokens_per_s']:.1f} tok/s, warm TTFT {m['ttft_ms_warm']:.1f} ms"
        if variant != "off":
            line += f" = {summary[variant]['throughput_ratio']:.3f} / {summary[variant]['ttft_ratio']:.2f}x of off"
        if hf_tok_s is not None:
            line += f"; {m['tokens_per_s'] / hf_tok_s:.2f}x transformers static batch 32 ({hf_tok_s:.1f} tok/s)"
        print(line)
    for variant in summary["median"]:
        for name, ok in summary.get(variant, {}).get("pass", {}).items():
            print(f"  {'PASS' if ok else 'FAIL'} {variant}: {name}")


def transformers_static(model_dir: Path, tokenizer: Tokenizer, args) -> float:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reqs = make_chat_requests(tokenizer, args.num_requests, args.prompt_len, args.output_len, seed=32, prefix="hf")
    return hf_static_batch(model, reqs, args.concurrency).output_tokens_per_s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shape",
        choices=SHAPES,
        default="reference",
        help="the engine's model: the 28M reference, or the 390M model of Qwen2.5-0.5B's shape (random weights)",
    )
    p.add_argument("--model-dir", type=Path, help="default: build/bench-safety-model[-390m]")
    p.add_argument("--rounds", type=int, default=2, help="how many times each variant's server runs")
    p.add_argument("--variants", default="off,on", help=f"comma-separated, in order, from {', '.join(VARIANTS)}")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--warm-requests", type=int, default=8)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--fake-engine",
        action="store_true",
        help="serve with the tests' echoing fake backend instead of the engine: the gate's own cost beside an "
        "engine that takes no CPU (as on a GPU host); implies --skip-transformers",
    )
    p.add_argument("--json", type=Path, help="also write the JSON line to this file")
    p.add_argument(
        "--server-log-dir",
        type=Path,
        help="keep each server's log here (server-VARIANT-ROUND.log); a failed round prints its end either way",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a server setting for every variant, e.g. engine.kernel_isa=avx2 (with ONEDNN_MAX_CPU_ISA=AVX2 in the "
        "environment: an AVX2-only CPU's paths on an AVX-512 one)",
    )
    args = p.parse_args(argv)
    if bad := [kv for kv in args.set if "=" not in kv]:
        p.error(f"--set takes KEY=VALUE, got {bad[0]!r}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.model_dir is None:
        suffix = "" if args.shape == "reference" else "-390m"
        args.model_dir = ROOT / "build" / f"bench-safety-model{suffix}"
    model_dir = in_own_thread(build_model, args.model_dir, args.shape)
    tokenizer = Tokenizer.from_dir(model_dir)
    reqs = make_chat_requests(tokenizer, args.num_requests, args.prompt_len, args.output_len, seed=32, prefix="s")
    prompts = [r.user_text for r in reqs]
    rng = random.Random(5)
    questions = [
        f"Question {i}: what does {rng.choice(prompts).split()[0]} mean here?" for i in range(args.warm_requests + 1)
    ]
    ttft_inputs = (system_prompt(tokenizer, args.system_len, seed=7), questions)
    variants = args.variants.split(",")
    if "off" not in variants or not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants: 'off' and any of {', '.join(VARIANTS)}")
    rounds = []
    for i in range(args.rounds):
        for variant in variants:
            rounds.append(asyncio.run(one_round(model_dir, variant, i, args, prompts, ttft_inputs)))
    skip_hf = args.skip_transformers or args.fake_engine
    hf = None if skip_hf else in_own_thread(transformers_static, model_dir, tokenizer, args)
    summary = summarize(rounds)
    chosen = dict(kv.split("=", 1) for kv in args.set)
    engine_device = chosen.get("engine.device", "cpu")
    if engine_device.startswith("cuda"):  # the engine's GPU named in the record (the gate stays on the CPU)
        import torch

        machine = {**machine_info(0.0, torch.device(engine_device)), "settings": chosen}
    else:
        machine = {**machine_info(0.0), "settings": chosen}
    print_report(rounds, summary, hf, machine, args.concurrency)
    record = {
        "machine": machine,
        "isa": [m.value for m in supported_modes()],
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": [asdict(r) for r in rounds],
        "summary": summary,
        "transformers_static_tok_s": hf,
    }
    line = json.dumps(record, default=float)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return record


if __name__ == "__main__":
    main()
