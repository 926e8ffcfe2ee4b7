"""Prompt-lookup speculation (engine.speculative_tokens) at one stream: out tok/s with and without it,
the share of drafts kept, and a check that both give the same tokens.

Two workloads, each with and without speculation in the same process (both engines loaded,
requests alternating between them, medians of the rounds):
- the bundled demo model (`models/demo-flagship`, trained text) answering held-out chat prompts,
  most of which it answers by quoting a word of the question: realistic text;
- the 390M model of Qwen2.5-0.5B's shape (bench_peers' random weights) continuing prompts that
  hold a repeated passage: a copying workload, where random weights also repeat themselves, so
  read it as the case speculation is for, not as typical chat.

    python -m bench.bench_speculation [--k 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_peers import MODELS, build_model  # noqa: E402
from engine.native.llm_engine import LLMEngine  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from settings import EngineConfig  # noqa: E402


def demo_prompts(n: int) -> tuple[Path, list[list[int]], tuple[int, ...]]:
    model_dir = ROOT / "models" / "demo-flagship"
    tokenizer = Tokenizer.from_dir(model_dir)
    records = [json.loads(line) for line in (ROOT / "models" / "heldout.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    prompts = []
    for record in rng.sample(records, n):
        user = [m for m in record["messages"] if m["role"] == "user"][:1]
        prompts.append(tokenizer.encode_chat(user))
    return model_dir, prompts, tuple(tokenizer.eos_token_ids)


def copy_prompts(n: int) -> tuple[Path, list[list[int]], tuple[int, ...]]:
    model_dir = build_model("qwen-390m")
    vocab = MODELS["qwen-390m"][1]["vocab_size"]
    rng = random.Random(1)
    prompts = []
    for _ in range(n):
        passage = [rng.randrange(3, vocab) for _ in range(40)]
        prompts.append([rng.randrange(3, vocab) for _ in range(20)] + passage + [rng.randrange(3, vocab)] + passage[:8])
    return model_dir, prompts, ()


def compare(model_dir: Path, prompts, eos, k: int, max_tokens: int, rounds: int) -> dict:
    """Both engines loaded at once; each prompt runs on one, then the other, alternating which
    goes first, `rounds` times: the machine's drift hits both alike. Medians over the rounds."""
    engines = {
        spec: LLMEngine.from_model_dir(
            model_dir, EngineConfig(kv_cache_bytes=256 << 20, speculative_tokens=spec), eos_token_ids=eos
        )
        for spec in (0, k)
    }
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    times: dict[int, list[float]] = {0: [], k: []}
    tokens: dict[int, int] = {0: 0, k: 0}
    outputs: dict[int, list[list[int]]] = {0: [], k: []}
    for r in range(rounds + 1):  # round 0 warms both up
        elapsed = {0: 0.0, k: 0.0}
        for i, prompt in enumerate(prompts):
            for spec in (0, k) if (r + i) % 2 == 0 else (k, 0):
                engine = engines[spec]
                engine.add_request(GenerationRequest(f"{r}-{i}", tuple(prompt), sampling))
                start, out = time.perf_counter(), []
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        out += o.new_token_ids
                elapsed[spec] += time.perf_counter() - start
                if r == 1:
                    outputs[spec].append(out)
                    tokens[spec] += len(out)
        if r:
            for spec in (0, k):
                times[spec].append(elapsed[spec])
    on = engines[k].stats()
    return {
        "tok_s_off": tokens[0] / statistics.median(times[0]),
        "tok_s_on": tokens[k] / statistics.median(times[k]),
        "tokens": tokens[k],
        "drafted": on.num_draft_tokens,
        "kept": on.num_accepted_draft_tokens,
        "same": outputs[0] == outputs[k],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    for name, make in (("demo-flagship, held-out chat", demo_prompts), ("390M random, copying", copy_prompts)):
        model_dir, prompts, eos = make(args.prompts)
        c = compare(model_dir, prompts, eos, args.k, args.max_tokens, args.rounds)
        kept = c["kept"] / c["drafted"] if c["drafted"] else float("nan")
        print(
            f"{name}: off {c['tok_s_off']:.1f} tok/s, speculative_tokens={args.k} {c['tok_s_on']:.1f} tok/s "
            f"({c['tok_s_on'] / c['tok_s_off']:.2f}x, medians of {args.rounds} rounds); drafts kept "
            f"{c['kept']}/{c['drafted']} ({kept:.0%}); {c['tokens']} tokens a round; same tokens: {c['same']}"
        )


if __name__ == "__main__":
    main()
