"""SQL for stored Responses: the response object and its input items, tied to a conversation.

A response lives as long as its conversation is live (deleted with it, purged with it after the
tier's retention); every read filters by organisation and by the conversation's `deleted_at`,
so another organisation's response, or one of a deleted conversation, is simply not found.
A background response is written at `queued` and updated as it runs; `status` mirrors the body's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiosqlite

from store.rows import fetch_all


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    conversation_id: str
    num_messages: int
    body_json: str
    input_items_json: str
    created_at: float
    status: str = "completed"  # the body's status: queued | in_progress while a background one runs


_COLUMNS = "r.id, r.conversation_id, r.num_messages, r.body_json, r.input_items_json, r.created_at, r.status"
UNFINISHED = ("queued", "in_progress")
_LIVE = (
    "FROM responses r JOIN conversations c ON c.id = r.conversation_id"
    " WHERE r.org_id = ? AND r.id = ? AND c.deleted_at IS NULL"
)


async def insert(conn: aiosqlite.Connection, org_id: str, response: StoredResponse) -> None:
    # OR REPLACE: a response whose client left during its own final write is written again by
    # the cut's path (api/responses_record.record_cut) with the same object; ids are random.
    await conn.execute(
        "INSERT OR REPLACE INTO responses (id, org_id, conversation_id, num_messages, body_json, input_items_json,"
        " created_at, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            response.id,
            org_id,
            response.conversation_id,
            response.num_messages,
            response.body_json,
            response.input_items_json,
            response.created_at or time.time(),
            response.status,
        ),
    )


async def update(
    conn: aiosqlite.Connection,
    org_id: str,
    response_id: str,
    *,
    status: str,
    body_json: str,
    num_messages: int | None = None,
) -> bool:
    """A background response's new state; False if it is gone (deleted meanwhile) or already final."""
    cursor = await conn.execute(
        "UPDATE responses SET status = ?, body_json = ?, num_messages = COALESCE(?, num_messages)"
        " WHERE org_id = ? AND id = ? AND status IN ('queued', 'in_progress')",
        (status, body_json, num_messages, org_id, response_id),
    )
    return cursor.rowcount > 0


async def fail_unfinished(conn: aiosqlite.Connection, error: dict[str, Any]) -> int:
    """Mark `failed` every response still queued or in progress (at startup: no process runs them)."""
    cursor = await conn.execute(
        "UPDATE responses SET status = 'failed',"
        " body_json = json_set(body_json, '$.status', 'failed', '$.error', json(?))"
        " WHERE status IN ('queued', 'in_progress')",
        (json.dumps(error),),
    )
    return cursor.rowcount


async def get(conn: aiosqlite.Connection, org_id: str, response_id: str) -> StoredResponse | None:
    rows = await fetch_all(conn, f"SELECT {_COLUMNS} {_LIVE}", (org_id, response_id))
    return StoredResponse(*tuple(rows[0])) if rows else None


async def delete(conn: aiosqlite.Connection, org_id: str, response_id: str) -> bool:
    cursor = await conn.execute(
        "DELETE FROM responses WHERE org_id = ? AND id = ? AND conversation_id IN"
        " (SELECT id FROM conversations WHERE deleted_at IS NULL)",
        (org_id, response_id),
    )
    return cursor.rowcount > 0
