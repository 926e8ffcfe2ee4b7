"""Load generator: mixed-tier chat streams at a multiple of capacity on a loopback server.

Starts `server.py` on 127.0.0.1 (or uses `--url`, which must be loopback), creates API keys
per tier with the store CLI and measures capacity with a short closed loop. Two scenarios:
`priority` (the default, `bench/priority.py`: one model with two sequences and a queue of 4,
clients that retry refusals; checks issue #15's targets and can write bench/RESULTS.md) and
`open-loop` (Poisson arrivals at `--overload` x capacity, per tier TTFT, ITL, 429s and 503s).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/load.py` as well as `python -m bench.load`

from testing.server_proc import ServerProcess  # noqa: E402

WORDS = "river cloud stone paper light garden window music morning table letter silver".split()


@dataclass(slots=True)
class Result:
    """What one request did, as the client saw it."""

    tier: str
    outcome: str  # completed | rejected | error | timeout | incomplete
    status: int | None = None  # HTTP status; None if no response arrived
    code: str | None = None  # error.code of a refusal
    latency_s: float | None = None  # to the end of the stream, or to a refusal's response
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    fallback_from: str | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    url: str
    mix: dict[str, float]  # tier -> share of arrivals
    keys: dict[str, list[str]]  # tier -> API keys
    max_tokens: int
    prompt_words: int
    timeout_s: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/load.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "config.toml", help="server config (spawned server)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="server --set, repeatable")
    p.add_argument("--model", type=Path, help="server --model: one model folder for every tier (one queue)")
    p.add_argument("--url", help="use a running loopback server instead of spawning one (needs --db)")
    p.add_argument("--db", type=Path, help="the server's database, to create keys (default: a temp file)")
    p.add_argument("--mix", default="free=0.5,plus=0.3,enterprise=0.2", help="tier shares of the arrivals")
    p.add_argument("--keys-per-tier", type=int, default=4)
    p.add_argument("--rate", type=float, help="arrivals per second; default: overload x measured capacity")
    p.add_argument("--overload", type=float, default=3.0, help="multiple of the measured capacity")
    p.add_argument("--duration-s", type=float, default=60.0, help="how long arrivals are sent")
    p.add_argument("--max-requests", type=int, default=1000, help="most arrivals in all")
    p.add_argument("--drain-s", type=float, default=60.0, help="wait this long for streams after the last arrival")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--calibrate-s", type=float, default=15.0)
    p.add_argument("--calibrate-concurrency", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=180.0, help="per-request limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the raw per-request results here")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--server-log", type=Path, help="spawned server's log file")
    p.add_argument("--scenario", choices=("priority", "open-loop"), default="priority")
    p.add_argument("--retry-s", type=float, default=0.25, help="priority: a refused client asks again after this")
    p.add_argument("--patience-s", type=float, default=10.0, help="priority: a client gives up after this")
    p.add_argument("--shares", default="0.2,0.3,0.5", help="priority: enterprise,plus,free shares of arrivals")
    p.add_argument(
        "--clients",
        type=int,
        default=0,
        help="priority: this many steady clients (a third per tier, a key each) instead of arrivals",
    )
    p.add_argument("--write-results", action="store_true", help="priority: write the table into bench/RESULTS.md")
    args = p.parse_args(argv)
    args.shares = tuple(float(x) for x in args.shares.split(","))
    return args


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for item in text.split(","):
        tier, _, share = item.partition("=")
        mix[tier.strip()] = float(share)
    total = sum(mix.values())
    return {tier: share / total for tier, share in mix.items()}


def require_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"refusing to load {host}: this tool only drives 127.0.0.1")


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--config", str(args.config), *(a for s in args.overrides for a in ("--set", s))]
    return flags if args.model is None else [*flags, "--model", str(args.model)]


def create_key(args: argparse.Namespace, db: Path, org: str, tier: str) -> str:
    cmd = [
        sys.executable,
        str(ROOT / "server.py"),
        *server_flags(args),
        "keys",
        "create",
        "--org",
        org,
        "--tier",
        tier,
        "--db",
        str(db),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"keys create failed: {out.stderr.strip()}")
    return [line for line in out.stdout.splitlines() if line.strip()][-1].strip()  # the secret comes last


def prompt(rng: random.Random, num_words: int) -> str:
    # A fresh nonce per request: identical greedy prompts would be coalesced into one generation.
    return f"[{rng.getrandbits(48):012x}] " + " ".join(rng.choice(WORDS) for _ in range(num_words))


async def one_request(session: aiohttp.ClientSession, plan: Plan, tier: str, key: str, text: str) -> Result:
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": plan.max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    result = Result(tier, "incomplete")
    start = time.perf_counter()
    try:
        async with asyncio.timeout(plan.timeout_s):
            async with session.post(
                plan.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as resp:
                result.status = resp.status
                result.fallback_from = resp.headers.get("x-fallback-from")
                if resp.status != 200:
                    result.latency_s = time.perf_counter() - start
                    result.outcome = "rejected" if resp.status in (429, 503) else "error"
                    result.code = await _error_code(resp)
                    return result
                await _read_stream(resp, result, start)
    except TimeoutError:
        result.outcome = "timeout"
    except aiohttp.ClientError as exc:
        result.outcome, result.code = "error", type(exc).__name__
    return result


async def _error_code(resp: aiohttp.ClientResponse) -> str | None:
    try:
        return (await resp.json()).get("error", {}).get("code")
    except (aiohttp.ContentTypeError, json.JSONDecodeError, AttributeError):
        return None


async def _read_stream(resp: aiohttp.ClientResponse, result: Result, start: float) -> None:
    last = None
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue  # blank separators and ": queued position=N" comments
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            result.outcome = "completed"
            result.latency_s = time.perf_counter() - start
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            result.outcome, result.code = "error", chunk["error"].get("code")
            return
        choices = chunk.get("choices") or [{}]
        if choices[0].get("delta", {}).get("content"):
            now = time.perf_counter()
            if last is None:
                result.ttft_s = now - start
            else:
                result.itls_s.append(now - last)
            last = now
            result.num_chunks += 1


async def calibrate(session: aiohttp.ClientSession, plan: Plan, seconds: float, concurrency: int) -> float:
    """Completed requests per second of a closed loop at `concurrency` (the capacity)."""
    rng = random.Random(1)
    deadline = time.perf_counter() + seconds
    keys = plan.keys["calibrate"]
    num_done = 0

    async def worker(i: int) -> None:
        nonlocal num_done
        while time.perf_counter() < deadline:
            result = await one_request(session, plan, "calibrate", keys[i % len(keys)], prompt(rng, plan.prompt_words))
            if result.outcome == "completed":
                num_done += 1
            elif result.outcome == "rejected":
                await asyncio.sleep(0.1)

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return num_done / (time.perf_counter() - start)


async def open_loop(session: aiohttp.ClientSession, plan: Plan, rate: float, args: argparse.Namespace) -> list[Result]:
    """Poisson arrivals at `rate` until duration or count runs out; then drain, then cut."""
    rng = random.Random(args.seed)
    tiers, weights = list(plan.mix), list(plan.mix.values())
    next_key = dict.fromkeys(tiers, 0)
    tasks: dict[asyncio.Task[Result], str] = {}  # task -> tier
    start = time.perf_counter()
    at_s = 0.0
    while len(tasks) < args.max_requests:
        at_s += rng.expovariate(rate)
        if at_s > args.duration_s:
            break
        await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
        tier = rng.choices(tiers, weights)[0]
        key = plan.keys[tier][next_key[tier] % len(plan.keys[tier])]
        next_key[tier] += 1
        tasks[asyncio.create_task(one_request(session, plan, tier, key, prompt(rng, plan.prompt_words)))] = tier
    done, pending = await asyncio.wait(tasks, timeout=args.drain_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [task.result() if task in done else Result(tier, "incomplete") for task, tier in tasks.items()]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(results: list[Result], tiers: list[str]) -> list[dict]:
    rows = []
    for tier in tiers:
        mine = [r for r in results if r.tier == tier]
        admitted = [r for r in mine if r.status == 200]
        refused = [r for r in mine if r.outcome == "rejected"]
        ttfts = [r.ttft_s for r in admitted if r.ttft_s is not None]
        itls = [x for r in admitted for x in r.itls_s]
        rows.append(
            {
                "tier": tier,
                "sent": len(mine),
                "admitted": len(admitted),
                "completed": sum(r.outcome == "completed" for r in mine),
                "429": sum(r.status == 429 for r in mine),
                "503": sum(r.status == 503 for r in mine),
                "errors": sum(r.outcome in ("error", "timeout") for r in mine),
                "fallbacks": sum(r.fallback_from is not None for r in admitted),
                "ttft_p50_ms": _ms(percentile(ttfts, 0.5)),
                "ttft_p99_ms": _ms(percentile(ttfts, 0.99)),
                "itl_p50_ms": _ms(percentile(itls, 0.5)),
                "itl_p99_ms": _ms(percentile(itls, 0.99)),
                "reject_p99_ms": _ms(percentile([r.latency_s for r in refused if r.latency_s is not None], 0.99)),
                "refusal_codes": _count_codes(refused),
            }
        )
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def _count_codes(results: list[Result]) -> dict[str, int]:
    codes: dict[str, int] = {}
    for r in results:
        codes[str(r.code)] = codes.get(str(r.code), 0) + 1
    return codes


COLUMNS = [
    "tier",
    "sent",
    "admitted",
    "completed",
    "429",
    "503",
    "errors",
    "fallbacks",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "reject_p99_ms",
]


def render(rows: list[dict], markdown: bool) -> str:
    cells = [[("-" if row[c] is None else str(row[c])) for c in COLUMNS] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        return "\n".join([*lines, *("| " + " | ".join(c) + " |" for c in cells)])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(COLUMNS)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*COLUMNS), *(fmt.format(*c) for c in cells)])


async def drive(args: argparse.Namespace, url: str, db: Path) -> None:
    from settings import load_settings

    mix = parse_mix(args.mix)
    tier_configs = load_settings(args.config, args.overrides).tiers
    priority = {tier: tier_configs[tier].priority if tier in tier_configs else 0 for tier in mix}
    keys = {tier: [create_key(args, db, f"load-{tier}", tier) for _ in range(args.keys_per_tier)] for tier in mix}
    if args.rate is None:
        top_tier = max(mix, key=priority.__getitem__)
        keys["calibrate"] = [create_key(args, db, "load-calibrate", top_tier) for _ in range(4)]
    plan = Plan(url, mix, keys, args.max_tokens, args.prompt_words, args.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue on the client side
    async with aiohttp.ClientSession(connector=connector) as session:
        rate = args.rate
        if rate is None:
            capacity = await calibrate(session, plan, args.calibrate_s, args.calibrate_concurrency)
            if capacity <= 0:
                raise SystemExit("calibration completed no request; is the server serving?")
            rate = args.overload * capacity
            print(
                f"capacity {capacity:.2f} req/s (closed loop, concurrency {args.calibrate_concurrency});"
                f" sending {rate:.2f} req/s",
                flush=True,
            )
            await asyncio.sleep(5.0)  # let the calibration streams and their queue drain
        wall = time.perf_counter()
        results = await open_loop(session, plan, rate, args)
        wall = time.perf_counter() - wall
    print(
        f"{len(results)} requests at {rate:.2f}/s over {wall:.1f} s (arrivals and drain),"
        f" max_tokens {args.max_tokens}, mix {args.mix}, {args.keys_per_tier} keys per tier"
    )
    rows = summarize(results, sorted(mix, key=lambda t: -priority[t]))
    print(render(rows, args.markdown))
    for row in rows:
        print(f"{row['tier']}: refusals by code {row['refusal_codes']}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"rate": rate, "rows": rows, "results": [dataclasses.asdict(r) for r in results]}, indent=1)
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scenario == "priority":
        return run_priority(args)
    if args.url is not None:
        require_loopback(args.url)
        if args.db is None:
            raise SystemExit("--url needs --db (the server's database) to create API keys")
        asyncio.run(drive(args, args.url.rstrip("/"), args.db))
        return 0
    with tempfile.TemporaryDirectory(prefix="load-") as tmp:
        db = args.db or Path(tmp) / "load.db"
        server = ServerProcess(
            [*server_flags(args), "--db", str(db)], log_path=args.server_log or Path(tmp) / "server.log"
        )
        server.start(timeout_s=300.0)
        try:
            asyncio.run(drive(args, server.base_url, db))
        finally:
            server.__exit__(None, None, None)
    return 0


def run_priority(args: argparse.Namespace) -> int:
    from bench import priority

    args.overrides = [*priority.SERVER_SETTINGS, *args.overrides]
    if args.model is None:
        from testing.tiny_model import build_tiny_llama

        args.model = ROOT / "build" / "load-model"
        if not (args.model / "config.json").exists():  # 8 layers, hidden 512, random weights (seed 0)
            build_tiny_llama(
                args.model,
                hidden_size=512,
                intermediate_size=1408,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=2,
                vocab_size=512,
                max_position_embeddings=1024,
            )
    with tempfile.TemporaryDirectory(prefix="load-") as tmp:
        db = Path(tmp) / "load.db"
        server = ServerProcess(
            [*server_flags(args), "--db", str(db)], log_path=args.server_log or Path(tmp) / "server.log"
        )
        server.start(timeout_s=300.0)
        try:
            import uvloop  # the client shares the machine with the server: keep its loop cheap

            run = uvloop.run(priority.drive(args, server.base_url, db))
        finally:
            server.__exit__(None, None, None)
    capacity = run.num_clients.pop("_capacity")
    rows = priority.summarize(run)
    checks = priority.targets(rows, run)
    header = _priority_header(args, capacity)
    text = priority.markdown(rows, checks, header)
    print(text)
    for row in rows:
        print(f"{row['tier']}: refusals by code {row['refusal_codes']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "results": [dataclasses.asdict(r) for r in run.results]}))
    if args.write_results:
        priority.write_results(text)
    return 0 if all(ok for *_, ok in checks) else 1


def _priority_header(args: argparse.Namespace, capacity: float) -> str:
    from bench import priority

    if args.clients:
        load = (
            f"{args.clients} streaming clients for {args.duration_s:g} s, {args.clients // 3} per tier, each on "
            f"its own key, asking again at once after an answer and {args.retry_s:g} s after a refusal"
        )
    else:
        load = (
            f"{args.overload:g}x that in client arrivals for {args.duration_s:g} s, shares enterprise/plus/free "
            f"{'/'.join(f'{x:g}' for x in args.shares)}; a refused client retries after {args.retry_s:g} s for "
            f"up to {args.patience_s:g} s"
        )
    return (
        f"{time.strftime('%Y-%m-%d')}, {priority.cpu_name()}, CPU fp32, one torch thread. Capacity "
        f"{capacity:.2f} req/s (closed loop of 6); {load}; max_tokens {args.max_tokens}. "
        f"Server: `{' '.join(priority.SERVER_SETTINGS)}`."
    )


if __name__ == "__main__":
    sys.exit(main())
