"""Run `server.py` as a real subprocess on a free loopback port, for end-to-end tests.

Starts the process, waits for /ready, exposes its base URL, and stops it (SIGTERM, then
SIGKILL after a timeout). Only ever binds 127.0.0.1. With `fake`, the process is
testing/fake_server.py: its native models are served by the echoing fake backend.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from testing.fake_backend import FakeBehaviour

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        args: list[str],
        *,
        fake: FakeBehaviour | None = None,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        preexec_fn=None,
        cafile: Path | None = None,
    ):
        self.port = free_port()
        self.cafile = cafile  # the server speaks HTTPS with a certificate this CA file verifies
        self.args = args
        self.fake = fake  # serve the native models with the fake backend (`--fake NAME` in args: only those)
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.preexec_fn = preexec_fn  # e.g. lower the child's open-files limit
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"{'https' if self.cafile else 'http'}://127.0.0.1:{self.port}"

    def urlopen(self, url: str, timeout: float = 10):
        """urllib's urlopen, trusting `cafile` when the server speaks HTTPS."""
        context = ssl.create_default_context(cafile=str(self.cafile)) if self.cafile else None
        return urllib.request.urlopen(url, timeout=timeout, context=context)

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        cmd = [sys.executable, str(ROOT / "server.py")]
        if self.fake is not None:
            cmd = [
                sys.executable,
                "-m",
                "testing.fake_server",
                "--token-delay-s",
                str(self.fake.token_delay_s),
                "--max-num-running",
                str(self.fake.max_num_running),
            ]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *self.args]
        # The child inherits the log file; the parent's copy is closed at once.
        with open(self.log_path or os.devnull, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=log, stderr=log, preexec_fn=self.preexec_fn
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with self.urlopen(self.base_url + "/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"server not ready after {timeout_s}s; see {self.log_path}")

    def terminate(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate()
            except subprocess.TimeoutExpired:
                pass
