"""The finish path in-process: a request abandoned while it waits in the queue keeps its ledger
row (status aborted) and is billed nothing, since the engine never worked on it."""

from __future__ import annotations

import asyncio
import sqlite3

from testing.fake_backend import FakeBehaviour
from tests.api.helpers import state_of

LONG = [{"role": "user", "content": " ".join(["word"] * 60)}]
USER = [{"role": "user", "content": "Hello there, friend."}]
ONE_SLOW_SLOT = FakeBehaviour(token_delay_s=0.03, max_num_running=1)  # one stream at a time, ~30 ms a token


async def test_a_request_abandoned_in_the_queue_is_recorded_aborted_with_zero_tokens(make_client, tmp_path):
    client = await make_client(
        'tiers.enterprise.models=["echo"]', "tiers.enterprise.wait_target_s=1000", behaviour=ONE_SLOW_SLOT
    )
    body = {"model": "echo", "stream": True}
    running = await client.post("/v1/chat/completions", json={**body, "messages": LONG})
    await running.content.readline()  # the first one holds the only slot
    waiting = await client.post("/v1/chat/completions", json={**body, "messages": USER})
    request_id = waiting.headers["X-Request-Id"]
    while not (await waiting.content.readline()).startswith(b": queued position="):
        pass
    waiting.close()  # gone while still queued
    await running.read()
    for _ in range(100):
        with sqlite3.connect(tmp_path / "chat.db") as con:
            rows = con.execute(
                "SELECT status, prompt_tokens, cached_tokens, completion_tokens, cost_usd"
                " FROM usage WHERE request_id = ?",
                (request_id,),
            ).fetchall()
        if rows:
            break
        await asyncio.sleep(0.05)
    assert rows == [("aborted", 0, 0, 0, 0.0)]
    assert state_of(client).models["echo"].backend.stats().num_running == 0
