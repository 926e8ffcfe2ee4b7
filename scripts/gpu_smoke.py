"""GPU smoke test: start server.py on one model with the TensorRT-LLM backend and exercise it.

For a GPU host with TensorRT-LLM installed (see docs/trtllm.md). Writes a throwaway config,
starts the server, waits for /ready, then runs one streaming request, a burst of concurrent
streams, a client abort, and (not with echo) a JSON-schema answer, a forced tool call and
top_logprobs, and prints TTFT and throughput. Exit code 0 only if all passed.
`--backend echo` (the tests' fake backend, which echoes the prompt; or native) dry-runs the script
itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "smoke"
QUESTIONS = (
    "Explain in a few sentences how a river reaches the sea.",
    "Write a short poem about servers that batch requests.",
    "List five uses of a hash table and say why each works.",
    "Describe the weather on a sunny day with a light breeze.",
)


@dataclass(frozen=True, slots=True)
class StreamResult:
    ok: bool
    ttft_ms: float | None
    total_ms: float
    num_completion_tokens: int
    finish_reason: str | None
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path, help="Hugging Face layout model folder")
    p.add_argument("--backend", default="trtllm", choices=("trtllm", "native", "echo"))
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32, help="streams in the burst")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--startup-timeout-s", type=float, default=1800.0, help="TensorRT-LLM loads for minutes")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="extra server setting, passed to server.py --set (repeatable)",
    )
    return p.parse_args(argv)


def write_config(args: argparse.Namespace, workdir: Path) -> Path:
    cfg = f"""
[server]
host = "127.0.0.1"
port = {args.port}
local_tier = "enterprise"
static_dir = {json.dumps(str(REPO_ROOT / "static"))}

[store]
path = {json.dumps(str(workdir / "smoke.db"))}
synchronous = "NORMAL"

[safety]
enabled = false

[trtllm]
tensor_parallel_size = {args.tensor_parallel_size}
max_batch_size = {args.max_batch_size}

[models.{MODEL_NAME}]
path = {json.dumps(str(args.model_dir.resolve()))}
backend = "{"native" if args.backend == "echo" else args.backend}"

[tiers.enterprise]
priority = 2
requests_per_minute = 1000000
tokens_per_minute = 1000000000
max_tokens = {max(args.max_tokens, 1024)}
max_context_tokens = 1000000
max_concurrent_streams = {args.concurrency * 2 + 4}
models = ["{MODEL_NAME}"]
"""
    path = workdir / "smoke.toml"
    path.write_text(cfg, encoding="utf-8")
    return path


def start_server(config: Path, overrides: list[str], log_file: Path, *, fake: bool) -> subprocess.Popen:
    entry = ["-m", "testing.fake_server"] if fake else [str(REPO_ROOT / "server.py")]
    cmd = [sys.executable, *entry, "--config", str(config)]
    for item in overrides:
        cmd += ["--set", item]
    log = log_file.open("wb")
    return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())


def stop_server(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # graceful: the backend shuts TensorRT-LLM and its MPI workers down
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def wait_ready(session: aiohttp.ClientSession, base: str, proc: subprocess.Popen, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            async with session.get(f"{base}/ready") as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


def chat_body(question: str, max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": question}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(
    session: aiohttp.ClientSession, base: str, body: dict, *, stop_after_chunks: int = 0, timeout_s: float = 600.0
) -> StreamResult:
    """One streaming request; with `stop_after_chunks` the client disconnects after that many."""
    started = time.monotonic()
    ttft_ms, num_chunks, usage, finish = None, 0, None, None
    try:
        async with session.post(
            f"{base}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return StreamResult(False, None, _ms(started), 0, None, f"HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return StreamResult(False, ttft_ms, _ms(started), 0, None, json.dumps(chunk["error"]))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        num_chunks += 1
                        ttft_ms = ttft_ms if ttft_ms is not None else _ms(started)
                    finish = choice.get("finish_reason") or finish
                if stop_after_chunks and num_chunks >= stop_after_chunks:
                    resp.close()  # the disconnect the server must turn into abort()
                    return StreamResult(True, ttft_ms, _ms(started), num_chunks, "client_abort")
    except (TimeoutError, aiohttp.ClientError) as exc:
        return StreamResult(False, ttft_ms, _ms(started), 0, None, f"{type(exc).__name__}: {exc}")
    num_tokens = (usage or {}).get("completion_tokens", 0)
    return StreamResult(finish is not None, ttft_ms, _ms(started), num_tokens, finish)


def _ms(started: float) -> float:
    return (time.monotonic() - started) * 1000.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def report(name: str, results: list[StreamResult], wall_s: float) -> bool:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tokens = sum(r.num_completion_tokens for r in ok)
    print(
        f"{name}: {len(ok)}/{len(results)} ok, {tokens} completion tokens in {wall_s:.2f} s "
        f"= {tokens / wall_s if wall_s else 0:.1f} tok/s"
    )
    if ttfts:
        print(
            f"  TTFT ms: p50 {statistics.median(ttfts):.0f}  p95 {_percentile(ttfts, 0.95):.0f}  max {max(ttfts):.0f}"
        )
    for r in results:
        if not r.ok:
            print(f"  failed: {r.error}")
    return len(ok) == len(results)


async def run_checks(args: argparse.Namespace, base: str, proc: subprocess.Popen) -> bool:
    async with aiohttp.ClientSession() as session:
        ready_s = await wait_ready(session, base, proc, args.startup_timeout_s)
        print(f"server ready after {ready_s:.1f} s (backend {args.backend}, model {args.model_dir})")
        passed = True
        started = time.monotonic()
        single = await stream_chat(
            session, base, chat_body(QUESTIONS[0], args.max_tokens), timeout_s=args.request_timeout_s
        )
        passed &= report("single stream", [single], time.monotonic() - started)
        bodies = [
            chat_body(QUESTIONS[i % len(QUESTIONS)] + f" (#{i})", args.max_tokens) for i in range(args.concurrency)
        ]
        started = time.monotonic()
        burst = await asyncio.gather(*(stream_chat(session, base, b, timeout_s=args.request_timeout_s) for b in bodies))
        passed &= report(f"burst of {args.concurrency}", list(burst), time.monotonic() - started)
        passed &= await check_abort(session, base, args)
        if args.backend != "echo":  # the echo backend decodes under no grammar
            passed &= await check_structured(session, base, args)
        return passed


# A schema whose every answer is short: an unconstrained model would not produce it by chance.
SMOKE_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
SMOKE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


async def check_structured(session: aiohttp.ClientSession, base: str, args: argparse.Namespace) -> bool:
    """response_format json_schema with top_logprobs, then a forced tool call; both must validate."""
    body = {
        **_unary(chat_body(QUESTIONS[3], 64)),
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "smoke", "schema": SMOKE_SCHEMA}},
    }
    answer = await _post(session, base, body, args.request_timeout_s)
    choice = (answer.get("choices") or [{}])[0]
    try:
        content = json.loads(choice["message"]["content"])
        schema_ok = (
            set(content) == {"ok", "size"} and isinstance(content["ok"], bool) and content["size"] in ("small", "large")
        )
    except (KeyError, TypeError, ValueError):
        schema_ok = False
    entries = (choice.get("logprobs") or {}).get("content") or []
    logprobs_ok = bool(entries) and all(len(e.get("top_logprobs", [])) == 2 for e in entries)
    print(
        f"json_schema: valid={schema_ok}; top_logprobs=2 on {len(entries)} tokens ok={logprobs_ok}"
        + ("" if schema_ok and logprobs_ok else f" ({json.dumps(answer)[:300]})")
    )
    body = {
        **_unary(chat_body(QUESTIONS[3], 64)),
        "tools": [SMOKE_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    answer = await _post(session, base, body, args.request_timeout_s)
    calls = ((answer.get("choices") or [{}])[0].get("message") or {}).get("tool_calls") or []
    try:
        tool_ok = len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]).get("unit") in ("c", "f")
    except (KeyError, TypeError, ValueError):
        tool_ok = False
    print(f"forced tool call: valid={tool_ok}" + ("" if tool_ok else f" ({json.dumps(answer)[:300]})"))
    return schema_ok and logprobs_ok and tool_ok


def _unary(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}


async def _post(session: aiohttp.ClientSession, base: str, body: dict, timeout_s: float) -> dict:
    async with session.post(
        f"{base}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as resp:
        return await resp.json()


async def check_abort(session: aiohttp.ClientSession, base: str, args: argparse.Namespace) -> bool:
    """Disconnect mid-stream; the engine must go idle and the next request must succeed."""
    aborted = await stream_chat(
        session, base, chat_body(QUESTIONS[1], args.max_tokens), stop_after_chunks=3, timeout_s=args.request_timeout_s
    )
    print(f"abort: disconnected after {aborted.num_completion_tokens} chunks (ok={aborted.ok})")
    idle = await wait_engine_idle(session, base, timeout_s=30.0)
    after = await stream_chat(session, base, chat_body(QUESTIONS[2], 16), timeout_s=args.request_timeout_s)
    print(f"after abort: next request ok={after.ok} finish_reason={after.finish_reason}")
    return aborted.ok and idle and after.ok


async def wait_engine_idle(session: aiohttp.ClientSession, base: str, timeout_s: float) -> bool:
    """Poll /metrics until every running-requests gauge of the model reads 0."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        async with session.get(f"{base}/metrics") as resp:
            text = await resp.text()
        lines = [
            ln
            for ln in text.splitlines()
            if not ln.startswith("#") and "running" in ln and f'model="{MODEL_NAME}"' in ln
        ]
        if not lines:
            print("  /metrics has no running-requests gauge for the model; idle check skipped")
            return True
        if all(float(ln.rsplit(" ", 1)[-1]) == 0 for ln in lines):
            print(f"  engine idle after the abort: {lines[0]}")
            return True
        await asyncio.sleep(0.5)
    print(f"  engine still busy {timeout_s:.0f} s after the abort: {lines}")
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.model_dir.is_dir():
        print(f"model folder not found: {args.model_dir}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
        workdir = Path(tmp)
        log_file = workdir / "server.log"
        proc = start_server(write_config(args, workdir), args.overrides, log_file, fake=args.backend == "echo")
        try:
            passed = asyncio.run(run_checks(args, f"http://127.0.0.1:{args.port}", proc))
        except (RuntimeError, aiohttp.ClientError) as exc:
            print(f"smoke test failed: {exc}", file=sys.stderr)
            passed = False
        finally:
            stop_server(proc)
        if not passed:
            print("---- server log (tail) ----", file=sys.stderr)
            print("\n".join(log_file.read_text(errors="replace").splitlines()[-60:]), file=sys.stderr)
    print("GPU SMOKE: PASS" if passed else "GPU SMOKE: FAIL")
    return 0 if passed else 1


if __name__ == "__main__":  # required: TensorRT-LLM's MPI workers re-import the main module
    sys.exit(main())
