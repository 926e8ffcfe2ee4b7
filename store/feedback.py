"""SQL for feedback on answers: a rating (thumbs up or down), a comment, and whether the user
regenerated the answer or edited the prompt it answered. One row per assistant message, with
the prompt and answer copied in, so it survives the truncation that regenerating and editing
do, and can be exported as evaluation or fine-tuning data. Purged with its conversation (conversations.purge).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiosqlite

from store.rows import fetch_all
from store.types import NotFound


@dataclass(frozen=True, slots=True)
class FeedbackChange:
    """The fields a request sets; None leaves a field as it is (clear_* clears it)."""

    rating: int | None = None  # 1 or -1
    clear_rating: bool = False
    comment: str | None = None
    clear_comment: bool = False
    regenerated: bool = False  # only ever set, never unset
    edited_prompt: str | None = None


@dataclass(frozen=True, slots=True)
class Feedback:
    message_id: str
    conversation_id: str
    model: str | None
    prompt: str
    answer: str
    rating: int | None
    comment: str | None
    regenerated: bool
    edited_prompt: str | None
    created_at: float
    updated_at: float


_COLUMNS = (
    "message_id, conversation_id, model, prompt, answer, rating, comment, regenerated, edited_prompt,"
    " created_at, updated_at"
)


def _row(row: sqlite3.Row) -> Feedback:
    values = list(row)
    values[7] = bool(values[7])
    return Feedback(*values)


async def upsert(
    conn: aiosqlite.Connection, org_id: str, conversation_id: str, message_id: str, change: FeedbackChange
) -> Feedback:
    """Create or update the feedback on one assistant message of a live conversation."""
    prompt, answer, model = await _rated_turn(conn, org_id, conversation_id, message_id)
    now = time.time()
    await conn.execute(
        f"INSERT INTO feedback (org_id, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, 0, NULL, ?, ?)"
        " ON CONFLICT (message_id) DO NOTHING",
        (org_id, message_id, conversation_id, model, prompt, answer, now, now),
    )
    sets, params = ["updated_at = ?"], list[object]([now])
    for column, value, clear in (
        ("rating", change.rating, change.clear_rating),
        ("comment", change.comment, change.clear_comment),
        ("edited_prompt", change.edited_prompt, False),
    ):
        if value is not None or clear:
            sets.append(f"{column} = ?")
            params.append(value)
    if change.regenerated:
        sets.append("regenerated = 1")
    await conn.execute(f"UPDATE feedback SET {', '.join(sets)} WHERE message_id = ?", (*params, message_id))
    rows = await fetch_all(conn, f"SELECT {_COLUMNS} FROM feedback WHERE message_id = ?", (message_id,))
    return _row(rows[0])


async def _rated_turn(
    conn: aiosqlite.Connection, org_id: str, conversation_id: str, message_id: str
) -> tuple[str, str, str | None]:
    """(the user message before it, the answer, its model); NotFound names what is missing."""
    rows = await fetch_all(
        conn,
        "SELECT m.seq, m.role, m.content, m.model FROM messages m JOIN conversations c ON c.id = m.conversation_id"
        " WHERE m.id = ? AND c.id = ? AND c.org_id = ? AND c.deleted_at IS NULL",
        (message_id, conversation_id, org_id),
    )
    if not rows:
        raise NotFound(f"no message {message_id!r} in conversation {conversation_id!r}")
    seq, role, answer, model = tuple(rows[0])
    if role != "assistant":
        raise NotFound(f"message {message_id!r} is not an answer (role {role!r}); only answers take feedback")
    prompt_rows = await fetch_all(
        conn,
        "SELECT content FROM messages WHERE conversation_id = ? AND seq < ? AND role = 'user'"
        " ORDER BY seq DESC LIMIT 1",
        (conversation_id, seq),
    )
    return (prompt_rows[0][0] if prompt_rows else ""), answer, model


async def for_conversation(conn: aiosqlite.Connection, conversation_id: str) -> dict[str, Feedback]:
    rows = await fetch_all(conn, f"SELECT {_COLUMNS} FROM feedback WHERE conversation_id = ?", (conversation_id,))
    return {row[0]: _row(row) for row in rows}


async def iterate(conn: aiosqlite.Connection, org_id: str | None) -> AsyncIterator[Feedback]:
    """Every feedback row, oldest change first (all organisations when org_id is None)."""
    where, params = ("WHERE org_id = ?", (org_id,)) if org_id is not None else ("", ())
    async with conn.execute(f"SELECT {_COLUMNS} FROM feedback {where} ORDER BY updated_at, message_id", params) as cur:
        async for row in cur:
            yield _row(row)
