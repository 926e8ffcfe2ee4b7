"""End to end: server.py with `backend = "trtllm"` over the stand-in, driven by scripts/gpu_smoke.py.

The same script a GPU host runs against real TensorRT-LLM; here `tensorrt_llm` resolves to
the stand-in through PYTHONPATH, so the whole path (HTTP, queue, has_room, disconnect ->
abort, metrics) runs through the adapter on CPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from contract_harness import STANDIN_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_gpu_smoke_script_passes_against_the_server_on_the_stand_in(tiny_model_dir, tmp_path):
    (tmp_path / "tensorrt_llm").symlink_to(STANDIN_DIR, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    cmd = [
        sys.executable,
        str(REPO_ROOT / "scripts" / "gpu_smoke.py"),
        str(tiny_model_dir),
        "--port",
        str(free_port()),
        "--concurrency",
        "6",
        "--max-tokens",
        "48",
        "--startup-timeout-s",
        "60",
        "--set",
        "trtllm.max_batch_size=2",
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "burst of 6: 6/6 ok" in result.stdout
    assert "engine idle after the abort" in result.stdout
    assert "json_schema: valid=True; top_logprobs=2" in result.stdout
    assert "forced tool call: valid=True" in result.stdout
    assert "GPU SMOKE: PASS" in result.stdout
