"""What a newcomer sees when `server.py` starts, as a real subprocess: a missing model folder
or a busy port ends the process at once with status 1 and a message saying what to do; a
config file's relative paths work from any directory; once up, one short block gives the URL,
the models and their tiers, and no SQLite warning is printed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from testing.server_proc import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVER = str(ROOT / "server.py")
EXIT_WITHIN_S = 120  # imports on a busy 2-core machine; a hang would be killed here

pytestmark = pytest.mark.slow


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SERVER, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=EXIT_WITHIN_S
    )


def test_missing_model_folder_exits_with_status_1_and_names_the_folder(tmp_path):
    result = _run(["--model", str(tmp_path / "no-such-model"), "--db", str(tmp_path / "chat.db")], tmp_path)
    assert result.returncode == 1, result.stderr
    assert "config error" in result.stderr and str(tmp_path / "no-such-model") in result.stderr
    assert "server_ready" not in result.stderr + result.stdout


def test_config_in_another_folder_relative_model_path_missing_exits_1(tmp_path):
    config = tmp_path / "conf" / "config.toml"
    config.parent.mkdir()
    config.write_text('[models.demo]\npath = "models/demo"\n[tiers.free]\nmodels = ["demo"]\n')
    result = _run(["--config", str(config)], tmp_path)
    assert result.returncode == 1
    assert str(tmp_path / "conf" / "models" / "demo") in result.stderr  # resolved against the file


def test_busy_port_exits_with_status_1_and_says_what_to_do(tmp_path, tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run(
            [
                "--model",
                str(tiny_model_dir),
                "--db",
                str(tmp_path / "chat.db"),
                "--port",
                str(port),
                "--set",
                "safety.enabled=false",
            ],
            tmp_path,
        )
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr and f"--port {port + 1}" in result.stderr
    assert "server_ready" not in result.stderr + result.stdout and "Traceback" not in result.stderr


def test_config_paths_resolve_against_the_config_file_and_ready_block_names_url_models_tiers(tmp_path, tiny_model_dir):
    conf = tmp_path / "conf"
    shutil.copytree(tiny_model_dir, conf / "models" / "tiny")
    port = free_port()
    (conf / "config.toml").write_text(
        f'[server]\nport = {port}\n[store]\npath = "data/chat.db"\n[safety]\nenabled = false\n'
        '[models.tiny]\npath = "models/tiny"\n'
        '[tiers.free]\nmodels = ["tiny"]\n[tiers.enterprise]\nmodels = ["tiny"]\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.Popen(
        [sys.executable, SERVER, "--config", str(conf / "config.toml")],
        cwd=elsewhere,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first_line = proc.stdout.readline()  # blocks until the ready block (or exit)
        assert (
            first_line
            == f"Ready. Open http://127.0.0.1:{port} in a browser (OpenAI-compatible API: http://127.0.0.1:{port}/v1).\n"
        )
        assert proc.stdout.readline() == "  model tiny: tiers free, enterprise\n"
        assert "No API key needed from this machine (tier enterprise; a client that must send one can send EMPTY)" in (
            proc.stdout.readline()
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=10) as resp:
            assert resp.status == 200
        assert (conf / "data" / "chat.db").is_file() and not (elsewhere / "data").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "WAL-reset" not in stderr and "3.52" not in stderr


def test_keys_command_prints_no_sqlite_warning(tmp_path):
    db = str(tmp_path / "chat.db")
    assert _run(["--db", db, "orgs", "create", "acme", "--tier", "free"], tmp_path).returncode == 0
    result = _run(["--db", db, "orgs", "list"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "WAL-reset" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--host", ""], "config error: server.host must not be empty"),
        (["--host", "[::1]"], "config error: server.host must be an address or host name alone"),
        (["--config", "."], "is a folder, not a config file"),
        (["--model", "Qwen/Qwen3-0.6B"], "downloads nothing, so download the model first (hf download Qwen/Qwen3-0.6B"),
        (
            ["--model", "x.Q4_K_M.gguf"],
            "x.Q4_K_M.gguf is a GGUF file; GGUF is not served as it is: turn it into a model folder with `server.py "
            "import-gguf",
        ),
    ],
)
def test_a_mistaken_flag_stops_the_start_with_one_config_error_line(tmp_path, args, message):
    (tmp_path / "x.Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(100))
    result = _run([*args, "--db", str(tmp_path / "chat.db")], tmp_path)
    assert result.returncode == 1 and message in result.stderr
    assert result.stderr.startswith("config error: ") and result.stderr.count("\n") == 1  # no traceback


def test_a_tilde_in_db_is_the_home_folder_not_a_folder_named_tilde(tmp_path):
    """`--db=~/chat.db` (the shell expands only `--db ~/chat.db`) made ./~/chat.db."""
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    result = _run(["--db=~/chat.db", "orgs", "create", "acme", "--tier", "free"], tmp_path, env)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "home" / "chat.db").is_file() and not (tmp_path / "~").exists()
