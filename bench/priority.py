"""The priority scenario of `make load`: one model at three times its capacity, three tiers.

One model with `engine.max_num_seqs=2` and a queue of 4, per-key limits raised so the queue
decides. Two shapes of load: arrivals (Poisson, 3x the capacity a closed loop measured
first) of clients of one tier, each on its own key, a refused one retrying `--retry-s` later
until served or out of patience; or, with `--clients N` (issue #15's retry storm), N clients
split evenly over the tiers, each on its own key, that ask again as soon as an answer ends
and `--retry-s` after a refusal, for `--duration-s`. A sampler reads /metrics meanwhile.
Prints, and with `--write-results` writes to bench/RESULTS.md, per tier: requests, served,
refused, TTFT and refusal latency, the wait a user sees (from the first try of an ask to its
first token, retries included), and checks the targets of issue #15.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.load import Plan, Result, _count_codes, calibrate, create_key, one_request, percentile, prompt
from settings import QueueConfig

TIERS = ("enterprise", "plus", "free")
SERVER_SETTINGS = (
    "engine.max_num_seqs=2",
    "queue.max_waiting_requests=4",
    "safety.enabled=false",
    "engine.num_threads=1",
    "tiers.free.requests_per_minute=100000",
    "tiers.plus.requests_per_minute=100000",
    "tiers.enterprise.requests_per_minute=100000",
)
RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Load: priority under overload (`make load`, issue #15)"


@dataclass(slots=True)
class Sample:
    running: float = 0.0  # the engine's own count of running sequences
    engine_waiting: float = 0.0  # requests the engine holds but has not started
    reserved: float = 0.0  # the gateway's reservations


@dataclass(slots=True)
class Run:
    results: list[Result] = field(default_factory=list)
    num_clients: dict[str, int] = field(default_factory=dict)
    num_clients_served: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    over_lower: dict[str, float] = field(default_factory=dict)  # server: refused while a lower tier waited
    over_lower_priority: dict[str, float] = field(default_factory=dict)  # ... a lower effective priority
    waits: dict[str, list[float]] = field(default_factory=dict)  # per tier: first try to first token, s
    unserved: dict[str, list[float]] = field(default_factory=dict)  # per tier: age of asks open at the end, s
    aging_s: float = QueueConfig().aging_s

    def add_wait(self, tier: str, asked_s: float, tried_s: float, result: Result) -> None:
        """A served ask: from its first try (`asked_s`) to the first token of the try that
        was served (started at `tried_s`), both time.perf_counter()."""
        if result.ttft_s is not None:
            self.waits.setdefault(tier, []).append(tried_s - asked_s + result.ttft_s)


def is_refusal(result: Result) -> bool:
    return result.outcome == "rejected" or (result.outcome == "error" and result.code == "queue_displaced")


async def client(
    session: aiohttp.ClientSession,
    plan: Plan,
    tier: str,
    key: str,
    rng: random.Random,
    args: argparse.Namespace,
    run: Run,
) -> None:
    """One user: ask; on a refusal wait retry_s and ask again, until served or out of patience."""
    asked_s = time.perf_counter()
    give_up = asked_s + args.patience_s
    run.num_clients[tier] = run.num_clients.get(tier, 0) + 1
    while True:
        tried_s = time.perf_counter()
        result = await one_request(session, plan, tier, key, prompt(rng, plan.prompt_words))
        run.results.append(result)
        if result.outcome == "completed":
            run.num_clients_served[tier] = run.num_clients_served.get(tier, 0) + 1
            run.add_wait(tier, asked_s, tried_s, result)
            return
        if time.perf_counter() + args.retry_s > give_up:
            return
        await asyncio.sleep(args.retry_s)


async def steady_client(
    session: aiohttp.ClientSession,
    plan: Plan,
    tier: str,
    key: str,
    rng: random.Random,
    args: argparse.Namespace,
    run: Run,
    deadline: float,
) -> None:
    """One user who keeps asking until `deadline`: at once after an answer, retry_s after a refusal."""
    run.num_clients[tier] = run.num_clients.get(tier, 0) + 1
    is_served = False
    asked_s = time.perf_counter()
    while (tried_s := time.perf_counter()) < deadline:
        result = await one_request(session, plan, tier, key, prompt(rng, plan.prompt_words))
        run.results.append(result)
        if result.outcome == "completed":
            is_served = True
            run.add_wait(tier, asked_s, tried_s, result)
            asked_s = time.perf_counter()
        else:
            await asyncio.sleep(args.retry_s)
    run.unserved.setdefault(tier, []).append(deadline - asked_s)
    if is_served:
        run.num_clients_served[tier] = run.num_clients_served.get(tier, 0) + 1


async def sample_metrics(session: aiohttp.ClientSession, url: str, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
        except aiohttp.ClientError:
            text = ""
        values = {
            name: sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))
            for name in ("chat_requests_running", "chat_engine_requests_waiting", "chat_requests_reserved")
        }
        run.samples.append(
            Sample(
                values["chat_requests_running"],
                values["chat_engine_requests_waiting"],
                values["chat_requests_reserved"],
            )
        )
        for counter, name in ((run.over_lower, "tier"), (run.over_lower_priority, "priority")):
            for tier, value in re.findall(
                rf'^chat_refused_over_lower_{name}_total\{{[^}}]*tier="(\w+)"[^}}]*\}} (\S+)$', text, re.M
            ):
                counter[tier] = float(value)
        await asyncio.sleep(0.1)


async def drive(args: argparse.Namespace, url: str, db: Path) -> Run:
    per_tier = args.clients // len(TIERS) if args.clients else args.keys_per_tier  # storm: a key per client
    keys = {tier: [create_key(args, db, f"prio-{tier}-{i}", tier) for i in range(per_tier)] for tier in TIERS}
    keys["calibrate"] = [create_key(args, db, "prio-calibrate", "enterprise")]
    plan = Plan(url, {}, keys, args.max_tokens, args.prompt_words, args.timeout_s)
    run = Run(aging_s=_aging_s(args.overrides))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        capacity = await calibrate(session, plan, args.calibrate_s, 6)
        print(f"capacity {capacity:.2f} req/s", flush=True)
        await asyncio.sleep(3.0)
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_metrics(session, url, run, stop))
        rng = random.Random(args.seed)
        if args.clients:
            await _storm(session, plan, keys, rng, args, run)
        else:
            await _arrivals(session, plan, keys, rng, args, run, args.overload * capacity)
        stop.set()
        await sampler
    run.num_clients["_capacity"] = capacity  # type: ignore[assignment]
    return run


async def _arrivals(
    session: aiohttp.ClientSession,
    plan: Plan,
    keys: dict[str, list[str]],
    rng: random.Random,
    args: argparse.Namespace,
    run: Run,
    rate: float,
) -> None:
    """Poisson arrivals of clients at `rate` per second for duration_s, each of one tier."""
    mix = {"enterprise": args.shares[0], "plus": args.shares[1], "free": args.shares[2]}
    tasks, next_key, start, at_s = [], dict.fromkeys(TIERS, 0), time.perf_counter(), 0.0
    while (at_s := at_s + rng.expovariate(rate)) < args.duration_s:
        await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
        tier = rng.choices(list(mix), list(mix.values()))[0]
        key = keys[tier][next_key[tier] % len(keys[tier])]
        next_key[tier] += 1
        tasks.append(asyncio.create_task(client(session, plan, tier, key, random.Random(rng.random()), args, run)))
    await asyncio.gather(*tasks)


async def _storm(
    session: aiohttp.ClientSession,
    plan: Plan,
    keys: dict[str, list[str]],
    rng: random.Random,
    args: argparse.Namespace,
    run: Run,
) -> None:
    """`--clients` steady clients, a third per tier, each on its own key, for duration_s."""
    deadline = time.perf_counter() + args.duration_s
    await asyncio.gather(
        *(
            steady_client(session, plan, tier, key, random.Random(rng.random()), args, run, deadline)
            for tier in TIERS
            for key in keys[tier]
        )
    )


def _aging_s(overrides: list[str]) -> float:
    values = [float(o.split("=", 1)[1]) for o in overrides if o.startswith("queue.aging_s=")]
    return values[-1] if values else QueueConfig().aging_s


def summarize(run: Run) -> list[dict]:
    rows = []
    for tier in TIERS:
        mine = [r for r in run.results if r.tier == tier]
        served = [r for r in mine if r.outcome == "completed"]
        refused = [r for r in mine if is_refusal(r)]
        # Refusal latency is the cost of saying no at arrival: a displaced request waited in
        # the queue first (its 503 comes when a higher tier takes its place), so it is not in it.
        quick = [
            r.latency_s
            for r in refused
            if r.status in (429, 503) and r.code != "queue_displaced" and r.latency_s is not None
        ]
        rows.append(
            {
                "tier": tier,
                "clients": run.num_clients.get(tier, 0),
                "clients_served": run.num_clients_served.get(tier, 0),
                "requests": len(mine),
                "served": len(served),
                "refused": len(refused),
                "displaced": sum(r.code == "queue_displaced" for r in refused),
                "other": len(mine) - len(served) - len(refused),
                "served_share": round(len(served) / len(mine), 3) if mine else 0.0,
                "ttft_p50_ms": _ms(percentile([r.ttft_s for r in served if r.ttft_s is not None], 0.5)),
                "ttft_p99_ms": _ms(percentile([r.ttft_s for r in served if r.ttft_s is not None], 0.99)),
                "refusal_p50_ms": _ms(percentile(quick, 0.5)),
                "refusal_p95_ms": _ms(percentile(quick, 0.95)),
                "refusal_p99_ms": _ms(percentile(quick, 0.99)),
                "wait_p50_s": _s(percentile(run.waits.get(tier, []), 0.5)),
                "wait_p99_s": _s(percentile(run.waits.get(tier, []), 0.99)),
                "wait_max_s": _s(max(run.waits.get(tier, []), default=None)),
                "unserved_max_s": _s(max(run.unserved.get(tier, []), default=None)),
                "refused_over_lower_tier": int(run.over_lower.get(tier, 0)),
                "refused_over_lower_priority": int(run.over_lower_priority.get(tier, 0)),
                "refusal_codes": _count_codes(refused),
            }
        )
    return rows


FREE_SERVED = "free still served, wait p99 <= enterprise's longest wait + 2 x aging_s + 1 s"


def targets(rows: list[dict], run: Run) -> list[tuple[str, str, bool]]:
    by = {row["tier"]: row for row in rows}
    most_running = max((s.running for s in run.samples), default=0)
    most_held = max((s.running + s.engine_waiting for s in run.samples), default=0)
    most_reserved = max((s.reserved for s in run.samples), default=0)
    p99s = [row["refusal_p99_ms"] for row in rows if row["refusal_p99_ms"] is not None]
    shares = [by[t]["served_share"] for t in TIERS]
    # Free is two levels below enterprise: it ranks with enterprise after 2 x aging_s of
    # asking, so it should wait at most that much longer than enterprise's longest wait (plus
    # a retry step and a first token: 1 s).
    bound_s = (by["enterprise"]["wait_max_s"] or 0.0) + 2 * run.aging_s + 1.0
    free_wait_s = by["free"]["wait_p99_s"]
    return [
        (
            "enterprise refused while a request of lower effective (aged) priority held a queue place",
            f"{by['enterprise']['refused_over_lower_priority']} (server counter)",
            by["enterprise"]["refused_over_lower_priority"] == 0,
        ),
        (
            "enterprise refused while a lower tier held a queue place (issue's wording: counts lower-tier "
            "requests that had aged past enterprise)",
            f"{by['enterprise']['refused_over_lower_tier']} (server counter)",
            by["enterprise"]["refused_over_lower_tier"] == 0,
        ),
        (
            "served share enterprise > plus > free",
            " > ".join(f"{s:.3f}" for s in shares),
            shares[0] > shares[1] > shares[2],
        ),
        (
            FREE_SERVED,
            f"{by['free']['served']} requests, wait p99 "
            + ("-" if free_wait_s is None else f"{free_wait_s:.1f} s")
            + f" (bound {bound_s:.1f} s)",
            by["free"]["served"] > 0 and free_wait_s is not None and free_wait_s <= bound_s,
        ),
        (
            "never more in the engine than its capacity (2)",
            f"max running {most_running:.0f}, held {most_held:.0f}, reserved {most_reserved:.0f}"
            f" over {len(run.samples)} samples",
            most_held <= 2 and most_reserved <= 2,
        ),
        ("refusals p99 < 50 ms", ", ".join(f"{p:.1f}" for p in p99s) + " ms", bool(p99s) and max(p99s) < 50.0),
    ]


COLUMNS = [
    "tier",
    "clients",
    "clients_served",
    "requests",
    "served",
    "refused",
    "displaced",
    "served_share",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "refusal_p50_ms",
    "refusal_p95_ms",
    "refusal_p99_ms",
    "wait_p50_s",
    "wait_p99_s",
    "unserved_max_s",
]


def markdown(rows: list[dict], checks: list[tuple[str, str, bool]], header: str) -> str:
    lines = [SECTION, "", header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join("-" if row[c] is None else str(row[c]) for c in COLUMNS) + " |" for row in rows]
    lines += ["", "| target | measured | |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {'met' if ok else 'MISSED'} |" for name, value, ok in checks]
    return "\n".join(lines) + "\n"


def write_results(section: str, path: Path = RESULTS_MD) -> None:
    """Replace this scenario's section of RESULTS.md (or put it first), keeping the rest."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    head, sep, rest = text.partition(SECTION)
    tail = ""
    if sep:
        following = re.search(r"^## ", rest[1:], re.M)
        tail = rest[1 + following.start() :] if following else ""
    else:
        first = re.search(r"^## ", text, re.M)
        head, tail = (text[: first.start()], text[first.start() :]) if first else (text + "\n", "")
    path.write_text(head + section + "\n" + tail, encoding="utf-8")


def cpu_name() -> str:
    """The CPU's model name and ISA from /proc/cpuinfo (AMD family 25 with AVX-512 is Zen 4)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in info.splitlines()[:30] if ":" in line)
    name = fields.get("model name\t", "unknown CPU").strip()
    has_avx512 = " avx512f" in info
    if "AMD" in name and fields.get("cpu family\t", "").strip() == "25" and has_avx512:
        name += " (Zen 4)"
    return f"{name}, {'AVX-512' if has_avx512 else 'no AVX-512'}, {os.cpu_count()} cores"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def _s(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)
