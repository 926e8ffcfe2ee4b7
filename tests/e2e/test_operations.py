"""What an operator meets, as real processes: start-up failures end in one line and exit 1 with
nothing left running, SIGHUP stops as gracefully as SIGTERM, the database lock sees through a
symlink, `--port 0` names the port it got, and `backup` copies a database a server is writing."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from testing.fake_backend import FakeBehaviour
from testing.server_proc import ROOT, ServerProcess
from tests.e2e.test_durability import write_config

SERVER = str(ROOT / "server.py")
EXIT_WITHIN_S = 120  # imports on a busy 2-core machine; a hang would be killed here

pytestmark = pytest.mark.slow


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SERVER, *args], cwd=cwd, capture_output=True, text=True, timeout=EXIT_WITHIN_S
    )


def _serve(tmp_path: Path, model_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """A server that fails to start: its settings and flags after the tiny model's."""
    return _run("--model", str(model_dir), "--port", "0", "--set", "safety.enabled=false", *args)


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_a_files_folder_that_cannot_be_made_stops_everything_started_and_exits_1(tmp_path, tiny_model_dir):
    db = tmp_path / "chat.db"
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    for files_dir in ("/proc/nope", str(not_a_folder / "files")):
        result = _serve(tmp_path, tiny_model_dir, "--db", str(db), "--set", f'files.dir="{files_dir}"')
        assert result.returncode == 1, result.stderr
        assert _last_line(result.stderr).startswith(
            f"config error: files.dir: cannot keep uploaded files in {files_dir}"
        )
        assert "Traceback" not in result.stderr and "server_ready" not in result.stderr
    # The lock went with the process: a good start on the same database works.
    with ServerProcess(["--config", write_config(tmp_path, tiny_model_dir), "--db", str(db)], fake=FakeBehaviour()):
        pass


def _newer_schema(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.execute("PRAGMA user_version = 99")


@pytest.mark.parametrize(
    "make, expected",
    [
        (_newer_schema, "newer than this server's"),
        (lambda path: path.write_bytes(b"\x07garbage, not SQLite" * 300), "file is not a database"),
        (lambda path: path.mkdir(), "Is a directory"),
    ],
    ids=["newer-schema", "not-a-database", "a-folder"],
)
def test_a_database_that_cannot_be_opened_is_one_line_and_exit_1(tmp_path, tiny_model_dir, make, expected):
    db = tmp_path / "chat.db"
    make(db)
    result = _serve(tmp_path, tiny_model_dir, "--db", str(db))
    assert result.returncode == 1, result.stderr
    line = _last_line(result.stderr)
    assert line.startswith(f"error: cannot open the database {db}") and expected in line, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (("--port", "70000"), "config error: server.port must be 0 to 65535; got 70000"),
        (("--set", "engine.block_size=0"), "config error: engine.block_size must be 1 or more; got 0"),
        (("--set", "engine.device=tpu"), "config error: engine.device must be one of auto, cpu, cuda, cuda:N"),
        (("--set", "store.synchronous=FAST"), "config error: store.synchronous must be one of OFF, NORMAL"),
    ],
)
def test_a_bad_value_stops_the_start_with_one_config_error_line(tmp_path, tiny_model_dir, args, expected):
    result = _serve(tmp_path, tiny_model_dir, "--db", str(tmp_path / "chat.db"), *args)
    assert result.returncode == 1
    assert result.stderr.startswith(expected) and len(result.stderr.splitlines()) == 1, result.stderr


def test_a_missing_web_ui_folder_is_a_config_error_naming_the_setting(tmp_path, tiny_model_dir):
    result = _serve(tmp_path, tiny_model_dir, "--db", str(tmp_path / "chat.db"), "--set", "server.static_dir=/nope")
    assert result.returncode == 1
    assert _last_line(result.stderr).startswith("config error: server.static_dir: no web UI in /nope")


def test_a_second_server_through_a_symlink_to_the_database_is_refused(tmp_path, tiny_model_dir):
    db = tmp_path / "chat.db"
    (tmp_path / "other").mkdir()
    link = tmp_path / "other" / "link.db"
    link.symlink_to(db)
    with ServerProcess(
        ["--config", write_config(tmp_path, tiny_model_dir), "--db", str(db)], fake=FakeBehaviour()
    ) as first:
        result = _serve(tmp_path, tiny_model_dir, "--db", str(link))
        assert result.returncode == 1
        assert "in use by another server" in result.stderr and str(first.proc.pid) in result.stderr


def test_port_0_reports_the_port_it_listens_on(tmp_path, tiny_model_dir):
    proc = subprocess.Popen(
        [sys.executable, SERVER, "--model", str(tiny_model_dir), "--port", "0", "--db", str(tmp_path / "chat.db")]
        + ["--set", "safety.enabled=false"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        first_line = proc.stdout.readline()
        url = first_line.split("Open ", 1)[1].split(" ", 1)[0]
        assert not url.endswith(":0"), first_line
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            assert resp.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def _chat(base_url: str, text: str, *, stream: bool) -> bytes:
    body = {"model": "echo", "stream": stream, "messages": [{"role": "user", "content": text}]}
    request = urllib.request.Request(
        base_url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return resp.read()


def test_sighup_lets_running_answers_finish_and_bills_them_like_sigterm(tmp_path, tiny_model_dir):
    """A closed terminal or ssh session sends SIGHUP; it killed the server mid-stream, unbilled."""
    db = tmp_path / "chat.db"
    assert _run("--db", str(db), "orgs", "create", "local", "--tier", "free").returncode == 0
    log = tmp_path / "server.log"
    args = ["--config", write_config(tmp_path, tiny_model_dir), "--db", str(db)]
    server = ServerProcess(args, fake=FakeBehaviour(token_delay_s=0.05), log_path=log).start()
    answers: list[bytes] = []
    streaming = threading.Thread(target=lambda: answers.append(_chat(server.base_url, "word " * 40, stream=True)))
    streaming.start()
    time.sleep(1.0)  # the stream is running (40 tokens, 2 s)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGHUP)
    streaming.join(60)
    assert server.proc.wait(60) == 0
    assert answers and answers[0].rstrip().endswith(b"data: [DONE]")
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT status FROM usage").fetchall() == [("finished",)]
    text = log.read_text()
    assert "signal=SIGHUP" in text and "stopped" in text
    # server.local_tier (enterprise in this config) wins over the tier given to `local` by hand, and says so.
    assert "local_org_tier_reset" in text and "new_tier=enterprise" in text


def test_backup_while_a_server_writes_restores_to_a_database_with_the_data(tmp_path, tiny_model_dir):
    db, copy = tmp_path / "chat.db", tmp_path / "backup" / "chat-copy.db"
    copy.parent.mkdir()
    config = write_config(tmp_path, tiny_model_dir)
    with ServerProcess(["--config", config, "--db", str(db)], fake=FakeBehaviour()) as server:
        _chat(server.base_url, "before the backup", stream=False)
        keep_writing = threading.Event()

        def write_more() -> None:
            while not keep_writing.is_set():
                _chat(server.base_url, "during the backup", stream=False)

        writer = threading.Thread(target=write_more)
        writer.start()
        try:
            result = _run("--config", config, "--db", str(db), "backup", "--out", str(copy))
        finally:
            keep_writing.set()
            writer.join(60)
        assert result.returncode == 0, result.stderr
        assert "uploaded files (files.dir)" in result.stdout and str(tmp_path / "files") in result.stdout
        again = _run("--config", config, "--db", str(db), "backup", "--out", str(copy))
        assert again.returncode == 1 and "already exists" in again.stderr  # never overwrites a backup
    # Restore: the copy is a whole database a server starts on, with what was written before the backup.
    with sqlite3.connect(copy) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        num_rows = conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0]
        assert num_rows >= 1
    with ServerProcess(["--config", config, "--db", str(copy)], fake=FakeBehaviour()) as restored:
        _chat(restored.base_url, "after the restore", stream=False)
    with sqlite3.connect(copy) as conn:
        assert conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0] == num_rows + 1
