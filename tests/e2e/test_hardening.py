"""Abusive clients against the real server process: malformed HTTP, slow headers and bodies,
more connections than the caps and the open-files limit allow, a second server on one database.

Raw loopback sockets only; each test opens a bounded number of them for a few seconds."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from testing.fake_backend import FakeBehaviour
from testing.server_proc import ROOT, ServerProcess
from tests.e2e.test_durability import write_config

pytestmark = pytest.mark.slow


def server_for(tmp_path, tiny_model_dir, *settings: str, **kwargs) -> ServerProcess:
    """A server over the fake backend; `with` starts it and stops it."""
    args = ["--config", write_config(tmp_path, tiny_model_dir), "--db", str(tmp_path / "chat.db")]
    for item in settings:
        args += ["--set", item]
    return ServerProcess(args, fake=FakeBehaviour(), log_path=tmp_path / "server.log", **kwargs)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return sock


def exchange(port: int, data: bytes) -> bytes:
    """Send raw bytes; read until the server closes the connection."""
    with connect(port) as sock:
        sock.sendall(data)
        return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head, head
    return status, json.loads(body)["error"]


def get_health(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
        return resp.status


MALFORMED = {
    "url_too_long": b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "header_too_long": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n",
    "bad_chunking": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"
    ),
    "bad_request_line": b"GET\x01 / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
}


def test_malformed_http_is_answered_in_the_openai_envelope_and_logged_as_one_warning(tiny_model_dir, tmp_path):
    with server_for(tmp_path, tiny_model_dir) as server:
        for name, data in MALFORMED.items():
            response = exchange(server.port, data)
            assert b"aiohttp" not in response.partition(b"\r\n\r\n")[0].lower(), name  # no versions to a stranger
            status, error = error_of(response)
            assert 400 <= status < 500, name
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "malformed_http", name
        assert get_health(server.port) == 200
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "[error" not in log
    warnings = [line for line in log.splitlines() if "] malformed_http " in line]
    assert len(warnings) == len(MALFORMED) and all("[warning" in line for line in warnings)


def test_slow_headers_and_bodies_hit_their_deadlines_and_the_caps_keep_new_clients_served(tiny_model_dir, tmp_path):
    settings = ("server.header_timeout_s=1.5", "server.body_timeout_s=1.5", "server.max_connections_per_client=20")
    with server_for(tmp_path, tiny_model_dir, *settings) as server:
        slow = [connect(server.port) for _ in range(40)]  # twice the per-client cap, headers never finish
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert get_health(server.port) == 200  # a new client still gets in: the oldest slow one is closed
        post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        status, error = error_of(exchange(server.port, post + b"Content-Length: 30000000\r\n\r\n{}"))
        assert (status, error["code"]) == (413, "request_too_large")
        stalled = connect(server.port)
        stalled.sendall(post + b"Content-Length: 1000\r\n\r\n" + b"{" * 10)
        status, error = error_of(read_all(stalled))
        assert (status, error["code"]) == (408, "request_timeout")
        upload = connect(server.port)  # a file upload that stops sending: the same deadline, between reads
        upload.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n"
            b"Content-Type: multipart/form-data; boundary=XX\r\n\r\n--XX\r\n"
            b'Content-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nhello'
        )
        status, error = error_of(read_all(upload))
        assert (status, error["code"]) == (408, "request_timeout")
        upload.close()
        status, error = error_of(read_all(slow[-1]))  # the header deadline answers and closes
        assert (status, error["code"]) == (408, "request_timeout")
        for sock in slow:
            sock.close()
        stalled.close()
        assert get_health(server.port) == 200
    log = (tmp_path / "server.log").read_text()
    assert "connection_limit" in log and "limit=per_client" in log
    assert "limit=header_timeout" in log and "body_timeout" in log
    assert "Traceback" not in log


def test_clients_that_stop_reading_their_answers_cannot_hold_every_slot(tiny_model_dir, tmp_path):
    """Connections that asked for large answers (the web UI's scripts) and never read them were
    busy for good, never evicted: a few held every slot and every new client, /health included,
    got 503 for as long as they liked. Their writes now time out and the slots come back."""
    settings = ("server.max_connections=6", "server.max_connections_per_client=6", "server.write_timeout_s=2")
    with server_for(tmp_path, tiny_model_dir, *settings) as server:
        readers = []
        for _ in range(6):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"GET /static/vendor/highlight/highlight.min.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 20)
            readers.append(sock)
        deadline = time.monotonic() + 15
        while True:  # a stalled one is evicted for a new client; all are closed once their writes time out
            try:
                if get_health(server.port) == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the stalled readers still hold every slot"
            time.sleep(0.5)
        time.sleep(4)  # past write_timeout_s: the sweep closes those the caps did not evict
        for sock in readers:
            sock.close()
    log = (tmp_path / "server.log").read_text()
    assert "limit=write_timeout" in log and "Traceback" not in log


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))


def test_more_connections_than_open_files_still_leaves_room_for_health_checks(tiny_model_dir, tmp_path):
    with server_for(tmp_path, tiny_model_dir, "server.header_timeout_s=5", preexec_fn=_low_fd_limit) as server:
        held = []
        try:
            for _ in range(260):  # more than the server's 200 open files
                sock = connect(server.port)
                sock.sendall(b"GET /health HTTP/1.1\r\n")
                held.append(sock)
            assert get_health(server.port) == 200
        finally:
            for sock in held:
                sock.close()
    log = (tmp_path / "server.log").read_text()
    assert "connection_cap_lowered_by_fd_limit" in log and "limit=total" in log
    assert "Too many open files" not in log and "Traceback" not in log


def test_a_second_server_on_the_same_database_stops_with_a_clear_message(tiny_model_dir, tmp_path):
    with server_for(tmp_path, tiny_model_dir) as first:
        second = subprocess.run(
            [
                sys.executable,
                "server.py",
                "--config",
                write_config(tmp_path, tiny_model_dir),
                "--db",
                str(tmp_path / "chat.db"),
                "--port",
                "0",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 1
        assert "in use by another server" in second.stderr and str(first.proc.pid) in second.stderr
        keys = subprocess.run(
            [
                sys.executable,
                "server.py",
                "keys",
                "create",
                "--org",
                "ops",
                "--tier",
                "enterprise",
                "--db",
                str(tmp_path / "chat.db"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert keys.returncode == 0, keys.stderr  # key management still works beside the server
        assert get_health(first.port) == 200
