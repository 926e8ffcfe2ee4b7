"""What the front door costs: the same streams sent straight to an upstream server and
through a second server that relays them (`backend = "openai"`), measured in one run.

Starts two `server.py` processes on loopback: the upstream on a model folder (default: a
tiny random Llama built by testing/tiny_model.py) and the front door in front of it, both
with the safety gate off. For each concurrency, a closed loop of streaming requests of
`--max-tokens` tokens (ignore_eos) goes to each; prints TTFT, ITL and tokens/s and the ratio.

    python -m bench.upstream [--model DIR] [--requests 32] [--max-tokens 64] [--conc 1 8]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.priority import cpu_name  # noqa: E402
from testing.server_proc import ServerProcess  # noqa: E402

TIER = """
[tiers.enterprise]
models = ["{name}"]
max_tokens = 1024
max_context_tokens = 100000
max_concurrent_streams = 1000
requests_per_minute = 1000000
tokens_per_minute = 1000000000
"""


def write_configs(tmp: Path, model_dir: Path, upstream_url: str) -> tuple[Path, Path]:
    common = '[server]\nlocal_tier = "enterprise"\n[safety]\nenabled = false\n'
    upstream = tmp / "upstream.toml"
    upstream.write_text(common + f'[models.m]\npath = "{model_dir}"\n' + TIER.format(name="m"))
    front = tmp / "front.toml"
    front.write_text(
        common + f'[models.m]\nbackend = "openai"\nurls = ["{upstream_url}"]\n'
        f'tokenizer = "{model_dir}"\nmax_in_flight = 256\n' + TIER.format(name="m")
    )
    return upstream, front


async def one_stream(
    session: aiohttp.ClientSession, url: str, max_tokens: int, i: int
) -> tuple[float, list[float], int, float]:
    """(TTFT, inter-token gaps, content chunks, time to the last token) of one stream, in seconds.
    The stream's end comes later: each server writes its ledger row (an fsync) before [DONE]."""
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Request {i}: tell me about rivers and the sea."}],
    }
    start = time.perf_counter()
    times: list[float] = []
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                times.append(time.perf_counter())
    itls = [b - a for a, b in itertools.pairwise(times)]
    return times[0] - start, itls, len(times), times[-1] - start


async def run(url: str, conc: int, num_requests: int, max_tokens: int) -> dict:
    queue = list(range(num_requests))
    results = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client() -> None:
            while queue:
                results.append(await one_stream(session, url, max_tokens, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(conc)))
        wall_s = time.perf_counter() - start
    ttfts = sorted(r[0] * 1000 for r in results)
    itls = sorted(x * 1000 for r in results for x in r[1])
    return {
        "tok_s": sum(r[2] for r in results) / wall_s,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[int(0.99 * (len(ttfts) - 1))],
        "itl_p50": statistics.median(itls),
        "last_token_p50": statistics.median(r[3] * 1000 for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="upstream model folder (default: a tiny random Llama)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--conc", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = args.model
        if model_dir is None:
            from testing.tiny_model import build_tiny_llama

            model_dir = build_tiny_llama(tmp / "tiny-llama")
        upstream = ServerProcess([], log_path=tmp / "upstream.log")
        upstream_cfg, front_cfg = write_configs(tmp, model_dir.resolve(), upstream.base_url + "/v1")
        upstream.args = ["--config", str(upstream_cfg), "--db", str(tmp / "up.db")]
        front = ServerProcess(["--config", str(front_cfg), "--db", str(tmp / "front.db")], log_path=tmp / "front.log")
        with upstream, front:
            asyncio.run(run(upstream.base_url, 2, 4, 8))  # warm up both paths
            asyncio.run(run(front.base_url, 2, 4, 8))
            rows = []
            for conc in args.conc:
                direct = asyncio.run(run(upstream.base_url, conc, args.requests, args.max_tokens))
                relayed = asyncio.run(run(front.base_url, conc, args.requests, args.max_tokens))
                rows.append((conc, direct, relayed))
    print(
        f"{time.strftime('%Y-%m-%d')}, {cpu_name()}; model {model_dir.name}; {args.requests} streams of "
        f"{args.max_tokens} tokens per row; both processes on this machine"
    )
    print("| conc | path | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | last token p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for conc, direct, relayed in rows:
        for name, r in (("upstream direct", direct), ("through the front door", relayed)):
            print(
                f"| {conc} | {name} | {r['tok_s']:.1f} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | "
                f"{r['itl_p50']:.2f} | {r['last_token_p50']:.1f} |"
            )
        print(
            f"| {conc} | front / direct | {relayed['tok_s'] / direct['tok_s']:.2f}x | "
            f"{relayed['ttft_p50'] / direct['ttft_p50']:.2f}x | | | |"
        )
    print(json.dumps({"rows": [[c, d, r] for c, d, r in rows]}))


if __name__ == "__main__":
    main()
