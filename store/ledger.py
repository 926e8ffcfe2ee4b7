"""SQL for the usage ledger: one row per request, the month spend, and usage summaries.

`record` is the only writer of billing data. It runs in one transaction with the conversation
turn, and `request_id` is the primary key, so a request can be billed at most once.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import aiosqlite

from store import conversations
from store.rows import fetch_all
from store.types import Message, RequestRecord

GROUP_BY = ("model", "day", "key", "org")

_GROUP_COLUMNS = {
    "model": ("u.model", "model"),
    "day": ("date(u.created_at, 'unixepoch')", "day"),  # UTC day, 'YYYY-MM-DD'
    "key": ("u.key_id", "key_id"),
    "org": ("u.org_id", "organization_id"),
}


def month_of(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m")


async def record(conn: aiosqlite.Connection, rec: RequestRecord) -> bool:
    """Write the ledger row, the month spend and the conversation turn; False if already written."""
    cursor = await conn.execute(
        "INSERT INTO usage (request_id, org_id, key_id, model, tier, status, prompt_tokens, cached_tokens,"
        " completion_tokens, cost_usd, queue_ms, ttft_ms, total_ms, created_at, finished_at,"
        " conversation_id, fallback_from, usage_source, reasoning_tokens, fallback_reason, history_messages_dropped)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (request_id) DO NOTHING",
        (
            rec.request_id,
            rec.org_id,
            rec.key_id,
            rec.model,
            rec.tier,
            rec.status.value,
            rec.prompt_tokens,
            rec.cached_tokens,
            rec.completion_tokens,
            rec.cost_usd,
            rec.queue_ms,
            rec.ttft_ms,
            rec.total_ms,
            rec.created_at,
            rec.finished_at,
            rec.conversation_id,
            rec.fallback_from,
            rec.usage_source,
            rec.reasoning_tokens,
            rec.fallback_reason,
            rec.history_messages_dropped,
        ),
    )
    if cursor.rowcount == 0:
        return False
    await conn.execute(
        "INSERT INTO org_month_spend (org_id, month, cost_usd) VALUES (?, ?, ?)"
        " ON CONFLICT (org_id, month) DO UPDATE SET cost_usd = cost_usd + excluded.cost_usd",
        (rec.org_id, month_of(rec.created_at), rec.cost_usd),
    )
    if rec.conversation_id is not None:
        # A conversation deleted while the answer streamed just doesn't get the turn; the
        # request is still billed.
        await conversations.append_turn(conn, rec.org_id, rec.conversation_id, _turn(rec), rec.request_id)
    return True


def _turn(rec: RequestRecord) -> list[Message]:
    new_id = conversations.new_message_id
    parts = rec.new_message_parts
    turn = [
        Message(new_id(), role, content, rec.created_at, parts_json=parts[i] if i < len(parts) else None)
        for i, (role, content) in enumerate(rec.new_messages)
    ]
    if rec.assistant_content is not None:
        turn.append(
            Message(
                new_id(),
                "assistant",
                rec.assistant_content,
                rec.finished_at,
                rec.completion_tokens,
                rec.model,
                finish_reason=rec.finish_reason,
            )
        )
    return turn


async def month_spend_usd(conn: aiosqlite.Connection, org_id: str, now: float) -> float:
    rows = await fetch_all(
        conn, "SELECT cost_usd FROM org_month_spend WHERE org_id = ? AND month = ?", (org_id, month_of(now))
    )
    return round(float(rows[0][0]), 9) if rows else 0.0  # float additions drift below a nano-dollar


async def summary(
    conn: aiosqlite.Connection, org_id: str | None, start: float | None, end: float | None, group_by: str
) -> list[dict[str, Any]]:
    """Token totals and cost per group, for `start <= created_at < end` (either bound optional).

    `org_id=None`: every organisation's rows; grouped by key or organisation, each row then also
    names its organisation."""
    if group_by not in _GROUP_COLUMNS:
        raise ValueError(f"group_by must be one of {GROUP_BY}, got {group_by!r}")
    expr, name = _GROUP_COLUMNS[group_by]
    where, params = "1", list[object]()
    if org_id is not None:
        where, params = "u.org_id = ?", [org_id]
    if start is not None:
        where += " AND u.created_at >= ?"
        params.append(start)
    if end is not None:
        where += " AND u.created_at < ?"
        params.append(end)
    extra = ", max(k.prefix) AS key_prefix, max(k.name) AS key_name" if group_by == "key" else ""
    if org_id is None and group_by in ("key", "org"):
        extra += ", max(o.name) AS organization"
    rows = await fetch_all(
        conn,
        f"SELECT {expr} AS {name}{extra}, count(*) AS num_requests,"
        " sum(u.prompt_tokens) AS prompt_tokens, sum(u.cached_tokens) AS cached_tokens,"
        " sum(u.completion_tokens) AS completion_tokens, round(sum(u.cost_usd), 9) AS cost_usd"
        " FROM usage u LEFT JOIN api_keys k ON k.id = u.key_id JOIN orgs o ON o.id = u.org_id"
        f" WHERE {where} GROUP BY {expr} ORDER BY {expr}",
        params,
    )
    return [dict(r) for r in rows]
