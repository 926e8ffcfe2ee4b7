"""Nothing acknowledged is lost: the database breaks under running answers, for real.

A full filesystem (a 4 MB tmpfs filled up) and a read-only database (`chattr +i` on the file
and its WAL, which even root cannot write) while a stream and a non-streaming request run:
the stream ends with a `store_unavailable` error instead of `finish_reason` + `[DONE]`, the
non-streaming request gets 503, /ready says not ready until a real write succeeds again, and
every answer that was acknowledged has its ledger row. Needs root (mount, chattr); skipped otherwise.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from testing.fake_backend import FakeBehaviour
from testing.server_proc import ServerProcess
from tests.e2e.test_durability import write_config

pytestmark = pytest.mark.slow

WORDS = " ".join(["word"] * 80)  # 80 tokens at 50 ms: a 4 s answer


def post(base_url: str, body: dict, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(
        base_url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def ready(base_url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(base_url + "/ready", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def in_background(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", fn(*args)))
    thread.start()
    return thread, out


def run_breakage(server: ServerProcess, db: Path, breaker) -> None:
    """One stream and one non-streaming answer running when `breaker()` breaks the store."""
    assert post(server.base_url, {"model": "echo", "messages": [{"role": "user", "content": "before"}]})[0] == 200
    stream, streamed = in_background(
        post, server.base_url, {"model": "echo", "stream": True, "messages": [{"role": "user", "content": WORDS}]}
    )
    unary, answered = in_background(
        post, server.base_url, {"model": "echo", "messages": [{"role": "user", "content": WORDS}]}
    )
    time.sleep(1.0)  # both are generating
    undo = breaker()
    try:
        stream.join(60)
        unary.join(60)
        status, text = streamed["result"]
        frames = [f for f in text.decode().split("\n\n") if f]
        last = json.loads(frames[-1].removeprefix("data: "))
        assert status == 200 and last["error"]["code"] == "store_unavailable", frames[-3:]
        assert "data: [DONE]" not in frames and '"finish_reason":"stop"' not in text.decode()
        status, body = answered["result"]
        assert status == 503 and json.loads(body)["error"]["code"] == "store_unavailable"
        code, body = ready(server.base_url)
        assert code == 503 and body["checks"]["store_writable"] is False
        refused = post(server.base_url, {"model": "echo", "messages": [{"role": "user", "content": "during"}]})
        assert refused[0] == 503
    finally:
        undo()
    deadline = time.monotonic() + 30
    while ready(server.base_url)[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready(server.base_url)[0] == 200  # a real write went through again
    status, body = post(server.base_url, {"model": "echo", "messages": [{"role": "user", "content": "after"}]})
    assert status == 200
    request_id = "req_" + json.loads(body)["id"].removeprefix("chatcmpl-")
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT status FROM usage WHERE request_id = ?", (request_id,)).fetchall() == [("finished",)]
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.fixture
def tmpfs(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def serve(tiny_model_dir, tmp_path: Path, db: Path) -> ServerProcess:
    return ServerProcess(
        [
            "--config",
            write_config(tmp_path, tiny_model_dir),
            "--db",
            str(db),
            "--set",
            "store.last_used_flush_s=0.2",
            "--set",
            "server.shutdown_grace_s=2",
        ],
        fake=FakeBehaviour(token_delay_s=0.05),
        log_path=tmp_path / "server.log",
    )


def test_a_full_filesystem_under_running_answers_loses_nothing_acknowledged(tiny_model_dir, tmp_path, tmpfs):
    db = tmpfs / "chat.db"
    filler = tmpfs / "filler"

    def fill():
        with open(filler, "wb", buffering=0) as f:
            try:
                while f.write(b"\0" * 65536):
                    pass
            except OSError:  # ENOSPC: the filesystem is full
                pass
        return lambda: filler.unlink()

    with serve(tiny_model_dir, tmp_path, db) as server:
        run_breakage(server, db, fill)


def test_a_read_only_database_under_running_answers_loses_nothing_acknowledged(tiny_model_dir, tmp_path):
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    db = tmp_path / "chat.db"

    def chattr(flag: str) -> bool:
        files = [str(p) for p in (db, Path(f"{db}-wal")) if p.exists()]
        return subprocess.run(["chattr", flag, *files], capture_output=True).returncode == 0

    with serve(tiny_model_dir, tmp_path, db) as server:
        if not chattr("+i") or not chattr("-i"):
            pytest.skip("this filesystem or user cannot make files immutable")

        def make_read_only():
            assert chattr("+i")
            return lambda: chattr("-i")

        run_breakage(server, db, make_read_only)
