"""SQL for stored Responses: the response object and its input items, tied to a conversation.

A response lives as long as its conversation is live (deleted with it, purged with it after the
tier's retention); every read filters by organisation and by the conversation's `deleted_at`,
so another organisation's response, or one of a deleted conversation, is simply not found.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiosqlite


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    conversation_id: str
    num_messages: int
    body_json: str
    input_items_json: str
    created_at: float


_COLUMNS = "r.id, r.conversation_id, r.num_messages, r.body_json, r.input_items_json, r.created_at"
_LIVE = (
    "FROM responses r JOIN conversations c ON c.id = r.conversation_id"
    " WHERE r.org_id = ? AND r.id = ? AND c.deleted_at IS NULL"
)


async def insert(conn: aiosqlite.Connection, org_id: str, response: StoredResponse) -> None:
    await conn.execute(
        "INSERT INTO responses (id, org_id, conversation_id, num_messages, body_json, input_items_json, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (response.id, org_id, response.conversation_id, response.num_messages, response.body_json,
         response.input_items_json, response.created_at or time.time()),
    )


async def get(conn: aiosqlite.Connection, org_id: str, response_id: str) -> StoredResponse | None:
    rows = await conn.execute_fetchall(f"SELECT {_COLUMNS} {_LIVE}", (org_id, response_id))
    return StoredResponse(*tuple(rows[0])) if rows else None


async def delete(conn: aiosqlite.Connection, org_id: str, response_id: str) -> bool:
    cursor = await conn.execute(
        "DELETE FROM responses WHERE org_id = ? AND id = ? AND conversation_id IN"
        " (SELECT id FROM conversations WHERE deleted_at IS NULL)",
        (org_id, response_id),
    )
    return cursor.rowcount > 0
