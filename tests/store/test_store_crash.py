"""kill -9 a process in the middle of recording requests; a fresh Store recovers everything acknowledged."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from settings import StoreConfig
from store.store import Store

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_RUNS = 3


def _run_and_kill(db_path: Path, run_id: str, rng: random.Random) -> tuple[set[str], str]:
    """Start the writer, let it acknowledge some records, SIGKILL it; return (acknowledged ids, conv id)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("crash_writer.py")), str(db_path), run_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO_ROOT,
        env=env,
        text=True,
    )
    assert child.stdout is not None
    conv_id = child.stdout.readline().split()[1]
    target = rng.randint(20, 200)
    acked: set[str] = set()
    deadline = time.monotonic() + 30
    while len(acked) < target and time.monotonic() < deadline:
        acked.add(child.stdout.readline().split()[1])
    os.kill(child.pid, signal.SIGKILL)
    # Lines written before the kill are acknowledged too.
    acked |= {line.split()[1] for line in child.stdout.read().splitlines() if line.startswith("ACK ")}
    child.wait()
    assert child.returncode == -signal.SIGKILL
    return acked, conv_id


async def test_kill_9_mid_write_keeps_every_acknowledged_record_exactly_once(db_path: Path) -> None:
    rng = random.Random(5)
    all_acked: set[str] = set()
    for run in range(NUM_RUNS):
        acked, _ = _run_and_kill(db_path, f"r{run}", rng)
        assert acked, "the writer acknowledged nothing"
        all_acked |= acked

        store = await Store.open(db_path, StoreConfig())  # recovers the WAL left by the kill
        try:
            assert await store.integrity_check() == "ok"
            assert store.is_writable
        finally:
            await store.close()
        billed, answered = _ledger_and_answers(db_path)
        assert all_acked <= billed  # every acknowledged request is billed
        assert answered == billed  # ledger row and assistant message committed together, once each


def _ledger_and_answers(db_path: Path) -> tuple[set[str], set[str]]:
    with sqlite3.connect(db_path) as conn:
        billed = [row[0] for row in conn.execute("SELECT request_id FROM usage")]
        answered = [row[0] for row in conn.execute("SELECT request_id FROM messages WHERE role = 'assistant'")]
    assert len(answered) == len(set(answered))  # no request answered twice
    return set(billed), set(answered)
