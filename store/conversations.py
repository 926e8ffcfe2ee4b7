"""SQL for conversations and their messages.

Every statement filters by `org_id` and by `deleted_at IS NULL`, so another organisation's
conversation, or a deleted one, is simply not found. Messages keep a 0-based `seq`; only a
tail is ever removed (regenerate / edit-and-resend), so `seq` stays contiguous. An answer's
billing is read from the ledger row of the request that wrote it (`messages.request_id`).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import aiosqlite

from store import shares
from store.rows import fetch_all
from store.types import Conversation, ImportedConversation, Message, NotFound

MAX_TITLE_CHARS = 80
# A conversation's columns, read from `conversations c` (conversation_of makes the value).
CONV_COLUMNS = "c.id, c.org_id, c.title, c.created_at, c.updated_at, c.metadata_json"
PAGE_ORDER = "c.updated_at DESC, c.id DESC"  # newest first: every page of conversations, listed or found
_LIVE = "org_id = ? AND id = ? AND deleted_at IS NULL"
_MESSAGE_COLUMNS = "m.id, m.role, m.content, m.created_at, m.tokens, m.model, m.parts_json, m.finish_reason"
_NUM_MESSAGE_COLUMNS = _MESSAGE_COLUMNS.count(",") + 1
# The ledger row of the request that wrote an answer (the message with a model); the messages
# the request brought (user turns, an assistant's replayed or prefilled text) share its id but
# not its bill. usage.prompt_tokens is NOT NULL, so a NULL there means no ledger row.
_BILLED_MESSAGES = (
    f"SELECT {_MESSAGE_COLUMNS}, u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.cost_usd, u.fallback_from,"
    " u.reasoning_tokens, u.fallback_reason, u.history_messages_dropped"
    " FROM messages m LEFT JOIN usage u"
    " ON u.request_id = m.request_id AND m.role = 'assistant' AND m.model IS NOT NULL"
    " WHERE m.conversation_id = ? ORDER BY m.seq"
)


@dataclass(frozen=True, slots=True)
class AnswerUsage:
    """What the ledger billed for the request that wrote one assistant message."""

    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, read from the prefix cache
    completion_tokens: int
    cost_usd: float
    fallback_from: str | None  # the model first chosen, when the router fell back
    reasoning_tokens: int = 0  # of completion_tokens, a reasoning model's thinking
    fallback_reason: str | None = None  # with fallback_from: busy, unavailable or over_budget
    history_messages_dropped: int = 0  # the conversation's oldest messages the prompt left out


def title_from(text: str) -> str | None:
    words = " ".join(text.split())
    if len(words) <= MAX_TITLE_CHARS:
        return words or None
    return words[: MAX_TITLE_CHARS - 1].rstrip() + "\u2026"


def new_message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


# --- reads ------------------------------------------------------------------------------


async def get(
    conn: aiosqlite.Connection, org_id: str, conversation_id: str, with_messages: bool
) -> Conversation | None:
    conv = await _conversation(conn, org_id, conversation_id)
    if conv is None or not with_messages:
        return conv
    msg_rows = await fetch_all(
        conn,
        f"SELECT {_MESSAGE_COLUMNS} FROM messages m WHERE m.conversation_id = ? ORDER BY m.seq",
        (conversation_id,),
    )
    return dataclasses.replace(conv, messages=tuple(Message(*tuple(r)) for r in msg_rows))


async def get_billed(
    conn: aiosqlite.Connection, org_id: str, conversation_id: str
) -> tuple[Conversation, dict[str, AnswerUsage]] | None:
    """The conversation with its messages and, by message id, each answer's ledger row, read in
    one query; an answer without a ledger row is not in the map."""
    conv = await _conversation(conn, org_id, conversation_id)
    if conv is None:
        return None
    rows = await fetch_all(conn, _BILLED_MESSAGES, (conversation_id,))
    messages = tuple(Message(*tuple(r)[:_NUM_MESSAGE_COLUMNS]) for r in rows)
    usage = {r["id"]: AnswerUsage(*tuple(r)[_NUM_MESSAGE_COLUMNS:]) for r in rows if r["prompt_tokens"] is not None}
    return dataclasses.replace(conv, messages=messages), usage


async def _conversation(conn: aiosqlite.Connection, org_id: str, conversation_id: str) -> Conversation | None:
    rows = await fetch_all(conn, f"SELECT {CONV_COLUMNS} FROM conversations c WHERE {_LIVE}", (org_id, conversation_id))
    return conversation_of(rows[0]) if rows else None


def conversation_of(row: Any) -> Conversation:
    metadata = json.loads(row["metadata_json"]) if row["metadata_json"] is not None else {}
    return Conversation(row["id"], row["org_id"], row["title"], row["created_at"], row["updated_at"], metadata=metadata)


async def list_page(
    conn: aiosqlite.Connection, org_id: str, limit: int, after: str | None
) -> tuple[list[Conversation], bool]:
    """Newest first by (updated_at, id); `after` is the last id of the previous page."""
    after_sql, after_params = await page_after(conn, org_id, after)
    rows = await fetch_all(
        conn,
        f"SELECT {CONV_COLUMNS} FROM conversations c WHERE c.org_id = ? AND c.deleted_at IS NULL{after_sql}"
        f" ORDER BY {PAGE_ORDER} LIMIT ?",
        (org_id, *after_params, limit + 1),
    )
    page = [conversation_of(r) for r in rows[:limit]]
    return page, len(rows) > limit


async def list_created_page(
    conn: aiosqlite.Connection, org_id: str, limit: int, before: tuple[float, str] | None
) -> list[Conversation]:
    """Newest created first by (created_at, id), which never change: paging by them neither skips
    nor repeats a conversation that gets a turn meanwhile, as PAGE_ORDER's updated_at would move
    it past the cursor (the export reads all pages). `before`: the last page's last (created_at, id)."""
    rows = await fetch_all(conn, *created_page_query(org_id, limit, before))
    return [conversation_of(r) for r in rows]


def created_page_query(org_id: str, limit: int, before: tuple[float, str] | None) -> tuple[str, tuple[Any, ...]]:
    """list_created_page's SQL and parameters (read in order from the conversations_created index)."""
    after_sql = ""
    params: list[Any] = [org_id]
    if before is not None:
        created_at, last_id = before
        after_sql = " AND (c.created_at < ? OR (c.created_at = ? AND c.id < ?))"
        params += [created_at, created_at, last_id]
    sql = (
        f"SELECT {CONV_COLUMNS} FROM conversations c WHERE c.org_id = ? AND c.deleted_at IS NULL{after_sql}"
        " ORDER BY c.created_at DESC, c.id DESC LIMIT ?"
    )
    return sql, (*params, limit)


async def page_after(conn: aiosqlite.Connection, org_id: str, after: str | None) -> tuple[str, list[Any]]:
    """The condition (` AND ...`, on conversations `c`) and its parameters that start a page after
    conversation `after` in PAGE_ORDER; nothing for the first page. NotFound: no such conversation."""
    if after is None:
        return "", []
    rows = await fetch_all(conn, "SELECT updated_at FROM conversations WHERE org_id = ? AND id = ?", (org_id, after))
    if not rows:
        raise NotFound(f"no conversation {after!r} to page after")
    updated_at = rows[0][0]
    return " AND (c.updated_at < ? OR (c.updated_at = ? AND c.id < ?))", [updated_at, updated_at, after]


# --- writes (inside the writer's transaction) -------------------------------------------


async def insert(
    conn: aiosqlite.Connection,
    org_id: str,
    title: str | None,
    pending: bool = False,
    metadata: dict[str, str] | None = None,
) -> Conversation:
    now = time.time()
    conv = Conversation(f"conv_{secrets.token_hex(12)}", org_id, title, now, now, metadata=dict(metadata or {}))
    await conn.execute(
        "INSERT INTO conversations (id, org_id, title, created_at, updated_at, pending, metadata_json)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (conv.id, org_id, title, now, now, int(pending), json.dumps(metadata) if metadata else None),
    )
    return conv


async def create(
    conn: aiosqlite.Connection,
    org_id: str,
    title: str | None,
    pending: bool,
    metadata: dict[str, str] | None,
    messages: tuple[Message, ...],
) -> Conversation:
    """A new conversation, holding `messages` when given (POST /v1/conversations with `items`)."""
    conv = await insert(conn, org_id, title, pending, metadata)
    if not messages:
        return conv
    await append_turn(conn, org_id, conv.id, list(messages), request_id=None)
    found = await get(conn, org_id, conv.id, with_messages=True)
    assert found is not None  # written in this transaction
    return found


async def branch(
    conn: aiosqlite.Connection,
    org_id: str,
    conversation_id: str,
    num_messages: int,
    pending: bool,
    title: str | None = None,
    last_message_id: str | None = None,
) -> Conversation | None:
    """A new conversation holding a copy of the first `num_messages` messages (new ids, the same
    answers' ledger rows), to continue from an earlier turn, titled `title` (None: the source's);
    None if the source is gone or shorter, or its last copied message is not `last_message_id`
    (when given: cut and written again since it was read)."""
    source = await get(conn, org_id, conversation_id, with_messages=False)
    counted = await fetch_all(conn, "SELECT count(*) FROM messages WHERE conversation_id = ?", (conversation_id,))
    if source is None or counted[0][0] < num_messages:
        return None
    if last_message_id is not None:
        last = await fetch_all(
            conn, "SELECT id FROM messages WHERE conversation_id = ? AND seq = ?", (conversation_id, num_messages - 1)
        )
        if not last or last[0][0] != last_message_id:
            return None
    conv = await insert(conn, org_id, title or source.title, pending=pending, metadata=source.metadata)
    await conn.execute(
        "INSERT INTO messages (id, conversation_id, seq, role, content, created_at, tokens, model, request_id,"
        " parts_json, finish_reason)"
        " SELECT 'msg_' || lower(hex(randomblob(12))), ?, seq, role, content, created_at, tokens, model, request_id,"
        " parts_json, finish_reason FROM messages WHERE conversation_id = ? AND seq < ? ORDER BY seq",
        (conv.id, conversation_id, num_messages),
    )
    return conv


async def stored_bytes(conn: aiosqlite.Connection, org_id: str) -> int:
    """Characters of message text and attachment references in the organisation's live conversations,
    and of its share links' snapshots (copies of such text)."""
    rows = await fetch_all(
        conn,
        "SELECT coalesce(sum(length(m.content) + coalesce(length(m.parts_json), 0)), 0) FROM messages m"
        " JOIN conversations c ON c.id = m.conversation_id WHERE c.org_id = ? AND c.deleted_at IS NULL",
        (org_id,),
    )
    return int(rows[0][0]) + await shares.stored_chars(conn, org_id)


async def discard_pending(conn: aiosqlite.Connection, org_id: str, conversation_id: str) -> bool:
    cursor = await conn.execute(
        "DELETE FROM conversations WHERE org_id = ? AND id = ? AND pending = 1", (org_id, conversation_id)
    )
    return cursor.rowcount > 0


async def delete_pending(conn: aiosqlite.Connection) -> int:
    """Delete the conversations Responses calls created whose first turn never got stored (the
    process died mid-answer); a background response's failed record keeps its conversation."""
    cursor = await conn.execute(
        "DELETE FROM conversations WHERE pending = 1 AND id NOT IN (SELECT conversation_id FROM responses)"
    )
    return cursor.rowcount


async def update(
    conn: aiosqlite.Connection,
    org_id: str,
    conversation_id: str,
    title: str | None,
    metadata: dict[str, str] | None = None,
    set_metadata: bool = False,
) -> Conversation | None:
    """Set the title (None: keep it) and, with `set_metadata`, the metadata (None or {}: none)."""
    cursor = await conn.execute(
        f"UPDATE conversations SET title = coalesce(?, title), updated_at = ?,"
        f" metadata_json = CASE WHEN ? THEN ? ELSE metadata_json END WHERE {_LIVE}",
        (title, time.time(), set_metadata, json.dumps(metadata) if metadata else None, org_id, conversation_id),
    )
    if cursor.rowcount == 0:
        return None
    return await get(conn, org_id, conversation_id, with_messages=False)


async def soft_delete(conn: aiosqlite.Connection, org_id: str, conversation_id: str) -> bool:
    """Mark it deleted (purged after the tier's retention); its share links go at once."""
    cursor = await conn.execute(
        f"UPDATE conversations SET deleted_at = ? WHERE {_LIVE}", (time.time(), org_id, conversation_id)
    )
    if cursor.rowcount == 0:
        return False
    await shares.delete_for_conversation(conn, conversation_id)
    return True


async def truncate(conn: aiosqlite.Connection, org_id: str, conversation_id: str, keep_messages: int) -> bool:
    if await get(conn, org_id, conversation_id, with_messages=False) is None:
        return False
    await conn.execute(
        "DELETE FROM messages WHERE conversation_id = ? AND seq >= ?", (conversation_id, max(0, keep_messages))
    )
    await conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (time.time(), conversation_id))
    return True


async def purge(conn: aiosqlite.Connection, retention_days_by_tier: dict[str, int], now: float) -> int:
    """Delete soft-deleted conversations older than their tier's retention; messages cascade.

    Tiers missing from the map keep the longest configured retention (30 days if none).
    """
    default_days = max(retention_days_by_tier.values(), default=30)
    total = 0
    for tier, days in retention_days_by_tier.items():
        total += await _purge_where(conn, "tier = ?", (tier,), now - days * 86400.0)
    tiers = tuple(retention_days_by_tier)
    placeholders = ", ".join("?" * len(tiers))
    other = f"tier NOT IN ({placeholders})" if tiers else "1"
    total += await _purge_where(conn, other, tiers, now - default_days * 86400.0)
    if total:
        await conn.execute("DELETE FROM feedback WHERE conversation_id NOT IN (SELECT id FROM conversations)")
    return total


async def _purge_where(conn: aiosqlite.Connection, org_filter: str, params: tuple[Any, ...], cutoff: float) -> int:
    cursor = await conn.execute(
        "DELETE FROM conversations WHERE deleted_at IS NOT NULL AND deleted_at < ?"
        f" AND org_id IN (SELECT id FROM orgs WHERE {org_filter})",
        (cutoff, *params),
    )
    return cursor.rowcount


async def append_turn(
    conn: aiosqlite.Connection, org_id: str, conversation_id: str, messages: list[Message], request_id: str | None
) -> bool:
    """Append messages (oldest first) and bump updated_at; title from the first user message."""
    rows = await fetch_all(
        conn, f"SELECT title, updated_at FROM conversations WHERE {_LIVE}", (org_id, conversation_id)
    )
    if not rows:
        return False
    title, updated_at = tuple(rows[0])
    seq_rows = await fetch_all(
        conn, "SELECT coalesce(max(seq) + 1, 0) FROM messages WHERE conversation_id = ?", (conversation_id,)
    )
    await _insert_messages(conn, conversation_id, seq_rows[0][0], messages, request_id)
    if title is None:
        title = next((title_from(m.content) for m in messages if m.role == "user"), None)
    latest = max([updated_at, *(m.created_at for m in messages)])
    await conn.execute(
        "UPDATE conversations SET title = ?, updated_at = ?, pending = 0 WHERE id = ?", (title, latest, conversation_id)
    )
    return True


async def _insert_messages(
    conn: aiosqlite.Connection, conversation_id: str, first_seq: int, messages: list[Message], request_id: str | None
) -> None:
    await conn.executemany(
        "INSERT INTO messages (id, conversation_id, seq, role, content, created_at, tokens, model, request_id,"
        " parts_json, finish_reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                m.id,
                conversation_id,
                first_seq + i,
                m.role,
                m.content,
                m.created_at,
                m.tokens,
                m.model,
                request_id,
                m.parts_json,
                m.finish_reason,
            )
            for i, m in enumerate(messages)
        ],
    )


async def insert_imported(
    conn: aiosqlite.Connection, org_id: str, imported: list[ImportedConversation]
) -> list[Conversation]:
    """Store conversations read from an export, each under a new id, keeping their titles, metadata,
    times and messages (in order; no ledger row: nothing was billed here). One job, so all or none."""
    created = []
    for item in imported:
        conv_id = f"conv_{secrets.token_hex(12)}"
        conv = Conversation(conv_id, org_id, item.title, item.created_at, item.updated_at, metadata=item.metadata)
        metadata_json = json.dumps(item.metadata) if item.metadata else None
        await conn.execute(
            "INSERT INTO conversations (id, org_id, title, created_at, updated_at, pending, metadata_json)"
            " VALUES (?, ?, ?, ?, ?, 0, ?)",
            (conv_id, org_id, item.title, item.created_at, item.updated_at, metadata_json),
        )
        await _insert_messages(conn, conv.id, 0, list(item.messages), request_id=None)
        created.append(conv)
    return created
