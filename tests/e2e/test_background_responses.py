"""Background Responses across a stopped or killed server process: never left `in_progress`.

SIGTERM: the shutdown drain waits `server.shutdown_grace_s`, cuts the response and stores it
`failed` itself. SIGKILL: nothing runs at the end; the next start marks the row `failed`.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from testing.fake_backend import FakeBehaviour
from testing.server_proc import ServerProcess

pytestmark = pytest.mark.slow

WORDS = " ".join(["river"] * 60)  # 60 tokens at 0.2 s each: still running when the server stops


def write_config(tmp_path, model_dir) -> str:
    path = tmp_path / "echo.toml"
    path.write_text(f"""
[server]
local_tier = "enterprise"
shutdown_grace_s = 0.5
[safety]
enabled = false
[models.echo]
path = "{model_dir}"
[tiers.enterprise]
models = ["echo"]
max_tokens = 256
""")
    return str(path)


def call(server: ServerProcess, method: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def start_running(server: ServerProcess) -> str:
    created = call(server, "POST", "/v1/responses", {"model": "echo", "input": WORDS, "background": True})
    assert created["status"] in ("queued", "in_progress")
    deadline = time.monotonic() + 20
    while call(server, "GET", f"/v1/responses/{created['id']}")["status"] != "in_progress":
        assert time.monotonic() < deadline, "never started"
        time.sleep(0.05)
    return created["id"]


def test_a_background_response_ends_failed_after_sigterm_and_after_kill_9(tiny_model_dir, tmp_path):
    args = ["--config", write_config(tmp_path, tiny_model_dir), "--db", str(tmp_path / "chat.db")]
    fake = FakeBehaviour(token_delay_s=0.2)
    server = ServerProcess(args, fake=fake, log_path=tmp_path / "first.log").start()
    cut = start_running(server)
    assert server.terminate() == 0
    server = ServerProcess(args, fake=fake, log_path=tmp_path / "second.log").start()
    try:
        after_cut = call(server, "GET", f"/v1/responses/{cut}")
        assert after_cut["status"] == "failed" and after_cut["error"]["code"] == "server_shutting_down", after_cut
        killed = start_running(server)
    finally:
        server.kill()  # SIGKILL: no shutdown code runs
    with ServerProcess(args, fake=fake, log_path=tmp_path / "third.log") as server:
        after_kill = call(server, "GET", f"/v1/responses/{killed}")
        assert after_kill["status"] == "failed" and after_kill["error"]["code"] == "server_error", after_kill
        assert call(server, "GET", f"/v1/responses/{cut}")["error"]["code"] == "server_shutting_down"


def test_a_turn_still_queued_at_sigterm_gets_503_and_is_not_stored(tiny_model_dir, tmp_path):
    """The 503 invites a retry: its user message was stored anyway, so the retry found it twice."""
    import threading
    import urllib.error

    args = ["--config", write_config(tmp_path, tiny_model_dir), "--db", str(tmp_path / "chat.db")]
    fake = FakeBehaviour(token_delay_s=0.2, max_num_running=1)
    server = ServerProcess(args, fake=fake, log_path=tmp_path / "first.log").start()
    conversation = call(server, "POST", "/v1/conversations", {})["id"]
    start_running(server)  # holds the one running slot
    outcome: list = []
    turn = {"model": "echo", "conversation_id": conversation, "messages": [{"role": "user", "content": "queued"}]}

    def send() -> None:
        try:
            outcome.append(call(server, "POST", "/v1/chat/completions", turn))
        except urllib.error.HTTPError as exc:
            outcome.append((exc.code, json.loads(exc.read())["error"]["code"]))

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(1.0)  # queued behind the running answer
    assert server.terminate() == 0
    sender.join(30)
    assert outcome == [(503, "server_shutting_down")], outcome
    with ServerProcess(args, fake=fake, log_path=tmp_path / "second.log") as server:
        assert call(server, "GET", f"/v1/conversations/{conversation}")["messages"] == []
