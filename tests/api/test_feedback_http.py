"""Feedback on answers through the API: thumbs, comments, regenerate and edit recorded per
answer in SQLite, shown in the conversation, validated with named fields, kept when the turn
is truncated, isolated per organisation, and exported by `server.py feedback export`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.helpers import assert_error, state_of

ROOT = Path(__file__).resolve().parents[2]


async def _answered(client, text: str = "What does water mean?") -> tuple[str, str]:
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    await client.post(
        "/v1/chat/completions",
        json={"model": "echo", "messages": [{"role": "user", "content": text}], "conversation_id": cid},
    )
    got = await (await client.get(f"/v1/conversations/{cid}")).json()
    return cid, got["messages"][1]["id"]


def _url(cid: str, mid: str) -> str:
    return f"/v1/conversations/{cid}/messages/{mid}/feedback"


async def test_rating_and_comment_are_stored_and_shown_with_the_conversation(make_client):
    client = await make_client()
    cid, mid = await _answered(client)
    resp = await client.post(_url(cid, mid), json={"rating": -1, "comment": "Wrong sense."})
    assert resp.status == 200
    body = await resp.json()
    assert body["rating"] == -1 and body["comment"] == "Wrong sense." and body["regenerated"] is False
    await client.post(_url(cid, mid), json={"rating": 1})  # changes the rating, keeps the comment
    got = await (await client.get(f"/v1/conversations/{cid}")).json()
    assert "feedback" not in got["messages"][0]
    feedback = got["messages"][1]["feedback"]
    assert (feedback["rating"], feedback["comment"]) == (1, "Wrong sense.")
    await client.post(_url(cid, mid), json={"rating": None, "comment": None})
    feedback = (await (await client.get(f"/v1/conversations/{cid}")).json())["messages"][1]["feedback"]
    assert (feedback["rating"], feedback["comment"]) == (None, None)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"rating": 5}, "rating"),
        ({"rating": True}, "rating"),
        ({"comment": 3}, "comment"),
        ({"comment": "x" * 2001}, "comment"),
        ({"regenerated": "yes"}, "regenerated"),
        ({"stars": 1}, "stars"),
        ({}, None),
    ],
)
async def test_bad_feedback_is_a_400_naming_the_field(make_client, body, param):
    client = await make_client()
    cid, mid = await _answered(client)
    await assert_error(await client.post(_url(cid, mid), json=body), 400, param=param)


async def test_feedback_on_a_missing_or_user_message_or_another_orgs_conversation_is_a_404(make_client):
    client = await make_client()
    cid, mid = await _answered(client)
    got = await (await client.get(f"/v1/conversations/{cid}")).json()
    user_mid = got["messages"][0]["id"]
    await assert_error(await client.post(_url(cid, user_mid), json={"rating": 1}), 404, param="message_id")
    await assert_error(await client.post(_url(cid, "msg_nope"), json={"rating": 1}), 404, param="message_id")
    store = state_of(client).store
    await store.create_org("other", "free")
    _key, secret = await store.create_key("other")
    resp = await client.post(_url(cid, mid), json={"rating": 1}, headers={"Authorization": f"Bearer {secret}"})
    await assert_error(resp, 404, param="message_id")


async def test_regenerate_and_edit_outlive_the_truncated_turn_and_are_exported(make_client, tmp_path):
    client = await make_client()
    cid, mid = await _answered(client)
    await client.post(_url(cid, mid), json={"regenerated": True, "rating": -1})
    await client.post(f"/v1/conversations/{cid}/truncate", json={"keep_messages": 1})
    _, second = await _answered(client, "What does fire mean?")
    await client.post(_url(*(await _answered(client, "hi"))), json={"edited_prompt": "hello"})
    db = state_of(client).store
    rows = await db.export_feedback()
    assert [(r.prompt, r.answer, r.regenerated, r.rating, r.edited_prompt) for r in rows] == [
        ("What does water mean?", "What does water mean?", True, -1, None),
        ("hi", "hi", False, None, "hello"),
    ]
    assert second not in {r.message_id for r in rows}  # never rated: not exported


@pytest.mark.slow
def test_feedback_export_command_writes_json_lines(tmp_path):
    import asyncio

    from settings import StoreConfig
    from store.feedback import FeedbackChange
    from store.store import Store
    from store.types import Message

    db = tmp_path / "chat.db"

    async def seed() -> None:
        store = await Store.open(db, StoreConfig())
        org = await store.ensure_org("local", "free")
        conv = await store.create_conversation(org.id)
        from store import conversations

        async def add(conn):
            await conversations.append_turn(
                conn,
                org.id,
                conv.id,
                [
                    Message("msg_u", "user", "What does fire mean?", 1.0),
                    Message("msg_a", "assistant", "The noun fire means ...", 2.0, 5, "demo-mini", finish_reason="stop"),
                ],
                "req_1",
            )

        await store._write(add)
        await store.set_feedback(org.id, conv.id, "msg_a", FeedbackChange(rating=1, comment="good"))
        await store.close()

    asyncio.run(seed())
    out = tmp_path / "feedback.jsonl"
    result = subprocess.run(
        [sys.executable, str(ROOT / "server.py"), "feedback", "export", "--db", str(db), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["prompt"] == "What does fire mean?" and row["answer"] == "The noun fire means ..."
    assert row["model"] == "demo-mini" and row["rating"] == 1 and row["comment"] == "good"
    assert row["edit"] == {"regenerated": False, "edited_prompt": None}


async def test_feedback_is_purged_with_its_deleted_conversation(make_client):
    import time

    client = await make_client()
    cid, mid = await _answered(client)
    await client.post(_url(cid, mid), json={"rating": 1})
    store = state_of(client).store
    await client.delete(f"/v1/conversations/{cid}")
    assert len(await store.export_feedback()) == 1  # soft-deleted: kept until the retention ends
    await store.purge_deleted({"enterprise": 1, "free": 1}, now=time.time() + 3 * 86400)
    assert await store.export_feedback() == []
