"""SQL for share links: a snapshot of a conversation (the public JSON, as served) under an
unguessable token, owned by the conversation's organisation.

Every statement an organisation makes filters by its `org_id`; the one public read goes by
token and finds only a share whose conversation is live. Tokens come from `secrets` alone and
are never derived from ids. A revoked share's row is deleted, as are a conversation's shares
when it is deleted (`delete_for_conversation`, from conversations.soft_delete) or purged (the
foreign key's cascade).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import aiosqlite

from store.rows import fetch_all
from store.types import NotFound, Share, ShareSnapshot

TOKEN_BYTES = 24  # 192 bits from secrets.token_urlsafe: a 32-character link token
_COLUMNS = "s.id, s.org_id, s.conversation_id, s.token, s.title, s.num_messages, s.last_message_id, s.created_at,"
_COLUMNS += " s.snapshot_at, length(s.snapshot_json)"
_PAGE_ORDER = "s.created_at DESC, s.id DESC"


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def _share_of(row: Any) -> Share:
    return Share(*tuple(row))


# --- reads ------------------------------------------------------------------------------


async def get(conn: aiosqlite.Connection, org_id: str, share_id: str) -> Share | None:
    rows = await fetch_all(conn, f"SELECT {_COLUMNS} FROM shares s WHERE s.org_id = ? AND s.id = ?", (org_id, share_id))
    return _share_of(rows[0]) if rows else None


async def list_page(
    conn: aiosqlite.Connection, org_id: str, conversation_id: str | None, limit: int, after: str | None
) -> tuple[list[Share], bool]:
    """Newest first by (created_at, id); only `conversation_id`'s when given; `after` is the last id
    of the previous page (NotFound: no such share of the organisation)."""
    where, params = "s.org_id = ?", [org_id]
    if conversation_id is not None:
        where += " AND s.conversation_id = ?"
        params.append(conversation_id)
    if after is not None:
        cursor = await fetch_all(conn, "SELECT created_at FROM shares WHERE org_id = ? AND id = ?", (org_id, after))
        if not cursor:
            raise NotFound(f"no share {after!r} to page after")
        created_at = cursor[0][0]
        where += " AND (s.created_at < ? OR (s.created_at = ? AND s.id < ?))"
        params += [created_at, created_at, after]
    rows = await fetch_all(
        conn, f"SELECT {_COLUMNS} FROM shares s WHERE {where} ORDER BY {_PAGE_ORDER} LIMIT ?", (*params, limit + 1)
    )
    return [_share_of(r) for r in rows[:limit]], len(rows) > limit


async def snapshot_by_token(conn: aiosqlite.Connection, token: str) -> str | None:
    """The public read: a share's snapshot JSON, when its conversation is live; one indexed lookup."""
    rows = await fetch_all(
        conn,
        "SELECT s.snapshot_json FROM shares s JOIN conversations c ON c.id = s.conversation_id"
        " WHERE s.token = ? AND c.deleted_at IS NULL",
        (token,),
    )
    return str(rows[0][0]) if rows else None


async def stored_chars(conn: aiosqlite.Connection, org_id: str) -> int:
    """Characters of the organisation's snapshots (they count against its conversation storage)."""
    rows = await fetch_all(
        conn, "SELECT coalesce(sum(length(snapshot_json)), 0) FROM shares WHERE org_id = ?", (org_id,)
    )
    return int(rows[0][0])


# --- writes (inside the writer's transaction) -------------------------------------------


async def insert(
    conn: aiosqlite.Connection, org_id: str, conversation_id: str, snapshot: ShareSnapshot
) -> Share | None:
    """A new share of the organisation's live conversation; None when it is not (deleted since
    the snapshot was read, or never its)."""
    share_id, token, now = f"share_{secrets.token_hex(12)}", new_token(), time.time()
    cursor = await conn.execute(
        "INSERT INTO shares (id, token, org_id, conversation_id, title, num_messages, last_message_id,"
        " snapshot_json, created_at, snapshot_at)"
        " SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS"
        " (SELECT 1 FROM conversations WHERE id = ? AND org_id = ? AND deleted_at IS NULL)",
        (
            share_id,
            token,
            org_id,
            conversation_id,
            snapshot.title,
            snapshot.num_messages,
            snapshot.last_message_id,
            snapshot.snapshot_json,
            now,
            snapshot.taken_at,
            conversation_id,
            org_id,
        ),
    )
    return await get(conn, org_id, share_id) if cursor.rowcount else None


async def replace_snapshot(
    conn: aiosqlite.Connection, org_id: str, share_id: str, snapshot: ShareSnapshot
) -> Share | None:
    """The share's snapshot taken again (the same token and link); None when it is gone."""
    cursor = await conn.execute(
        "UPDATE shares SET title = ?, num_messages = ?, last_message_id = ?, snapshot_json = ?, snapshot_at = ?"
        " WHERE org_id = ? AND id = ?",
        (
            snapshot.title,
            snapshot.num_messages,
            snapshot.last_message_id,
            snapshot.snapshot_json,
            snapshot.taken_at,
            org_id,
            share_id,
        ),
    )
    return await get(conn, org_id, share_id) if cursor.rowcount else None


async def delete(conn: aiosqlite.Connection, org_id: str, share_id: str) -> bool:
    """Revoke: the row goes, its snapshot with it; the link answers 404 from now on."""
    cursor = await conn.execute("DELETE FROM shares WHERE org_id = ? AND id = ?", (org_id, share_id))
    return cursor.rowcount > 0


async def delete_for_conversation(conn: aiosqlite.Connection, conversation_id: str) -> None:
    await conn.execute("DELETE FROM shares WHERE conversation_id = ?", (conversation_id,))
