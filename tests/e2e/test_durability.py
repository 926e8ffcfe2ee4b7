"""Crash durability of the ledger: kill -9 the server mid-stream, restart, check the books.

Every stream that completed before the kill has exactly one ledger row and its assistant
message; the database passes integrity_check; nothing is billed twice; the server serves again.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import urllib.request

import aiohttp
import pytest

from testing.fake_backend import FakeBehaviour
from testing.server_proc import ServerProcess

pytestmark = pytest.mark.slow

ROUNDS = 3


def write_config(tmp_path, model_dir) -> str:
    path = tmp_path / "echo.toml"
    path.write_text(
        f"""
[server]
local_tier = "enterprise"
[safety]
enabled = false
[models.echo]
path = "{model_dir}"
[tiers.enterprise]
models = ["echo"]
max_tokens = 256
max_concurrent_streams = 64
requests_per_minute = 10000
"""
    )
    return str(path)


async def one_stream(client: aiohttp.ClientSession, base_url: str, conv_id: str, words: int) -> str | None:
    """Returns the completion id when the stream reached [DONE], else None."""
    body = {
        "model": "echo",
        "stream": True,
        "conversation_id": conv_id,
        "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
    }
    completion_id = None
    try:
        async with client.post(base_url + "/v1/chat/completions", json=body) as resp:
            async for raw in resp.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("data: {") and completion_id is None:
                    completion_id = json.loads(line[6:])["id"]
                if line == "data: [DONE]":
                    return completion_id
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        return None
    return None


async def run_round(base_url: str):
    """Start short and long streams at once; returns (completion_id, conv_id) of completed ones."""
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    conv_ids = []
    for _ in range(6):
        async with client.post(base_url + "/v1/conversations", json={}) as resp:
            conv_ids.append((await resp.json())["id"])
    tasks = [
        asyncio.create_task(one_stream(client, base_url, cid, 3 if i % 2 == 0 else 200))
        for i, cid in enumerate(conv_ids)
    ]
    done, _pending = await asyncio.wait(tasks, timeout=2.0)  # the short ones finish
    completed = [(t.result(), conv_ids[tasks.index(t)]) for t in done if t.result()]
    return completed, tasks, client


def test_kill_9_mid_stream_loses_nothing_acknowledged_and_bills_nothing_twice(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir)
    db = tmp_path / "chat.db"
    args = ["--config", config, "--db", str(db)]
    fake = FakeBehaviour(token_delay_s=0.02)
    all_completed: list[tuple[str, str]] = []
    for i in range(ROUNDS):
        server = ServerProcess(args, fake=fake, log_path=tmp_path / f"server{i}.log").start()

        async def scenario(proc: ServerProcess) -> list[tuple[str, str]]:
            completed, tasks, client = await run_round(proc.base_url)
            proc.kill()  # SIGKILL while the long streams are still running
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()
            return completed

        completed = asyncio.run(scenario(server))
        assert completed, "some short streams completed before the kill"
        all_completed.extend(completed)

        con = sqlite3.connect(db)
        try:
            assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            for completion_id, _conv_id in all_completed:
                request_id = "req_" + completion_id.removeprefix("chatcmpl-")
                rows = con.execute("SELECT status FROM usage WHERE request_id = ?", (request_id,)).fetchall()
                assert rows == [("finished",)], (request_id, rows)
                msgs = con.execute(
                    "SELECT role FROM messages WHERE request_id = ? ORDER BY seq", (request_id,)
                ).fetchall()
                assert ("assistant",) in msgs
            dup = con.execute("SELECT request_id, COUNT(*) c FROM usage GROUP BY request_id HAVING c > 1").fetchall()
            assert dup == []
        finally:
            con.close()

    with ServerProcess(args, fake=fake, log_path=tmp_path / "final.log") as server:  # serves again
        body = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "still here"}]}).encode()
        req = urllib.request.Request(
            server.base_url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["choices"][0]["message"]["content"] == "still here"
