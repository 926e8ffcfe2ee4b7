"""SQL for uploaded files' metadata: insert within the organisation's quota, list, get, delete.

Every statement filters by `org_id`, and reads skip expired rows, so another organisation's
file, or one past its retention, is simply not found. The bytes on disk belong to
`store.blobs`; nothing here touches the file system.
"""

from __future__ import annotations

import sqlite3

import aiosqlite

from store.rows import fetch_all
from store.types import FileQuery, FileQuota, QuotaExceeded, StoredFile

_COLUMNS = "id, org_id, filename, purpose, bytes, sha256, media_type, created_at, expires_at"
_LIVE = "org_id = ? AND (expires_at IS NULL OR expires_at > ?)"


def _row(row: sqlite3.Row) -> StoredFile:
    return StoredFile(*tuple(row))


async def usage(conn: aiosqlite.Connection, org_id: str, now: float) -> tuple[int, int]:
    """(number of files, total bytes) the organisation keeps now."""
    rows = await fetch_all(conn, f"SELECT count(*), coalesce(sum(bytes), 0) FROM files WHERE {_LIVE}", (org_id, now))
    return int(rows[0][0]), int(rows[0][1])


async def insert(conn: aiosqlite.Connection, f: StoredFile, quota: FileQuota) -> StoredFile:
    """Insert `f` unless the organisation would pass its quota (checked in the same transaction)."""
    num_files, num_bytes = await usage(conn, f.org_id, f.created_at)
    if num_files + 1 > quota.max_files:
        raise QuotaExceeded(f"the organisation keeps {num_files} files; its tier allows {quota.max_files}")
    if num_bytes + f.bytes > quota.max_bytes:
        raise QuotaExceeded(
            f"the organisation keeps {num_bytes} bytes of files; this file of {f.bytes} bytes would pass"
            f" its tier's {quota.max_bytes}"
        )
    await conn.execute(
        f"INSERT INTO files ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (f.id, f.org_id, f.filename, f.purpose, f.bytes, f.sha256, f.media_type, f.created_at, f.expires_at),
    )
    return f


async def get(conn: aiosqlite.Connection, org_id: str, file_id: str, now: float) -> StoredFile | None:
    rows = await fetch_all(conn, f"SELECT {_COLUMNS} FROM files WHERE {_LIVE} AND id = ?", (org_id, now, file_id))
    return _row(rows[0]) if rows else None


async def get_many(conn: aiosqlite.Connection, org_id: str, file_ids: list[str], now: float) -> dict[str, StoredFile]:
    """The live files among `file_ids`, by id, in one query per 500 ids (SQLite's bound on variables)."""
    found: dict[str, StoredFile] = {}
    for start in range(0, len(file_ids), 500):
        chunk = file_ids[start : start + 500]
        marks = ", ".join("?" * len(chunk))
        sql = f"SELECT {_COLUMNS} FROM files WHERE {_LIVE} AND id IN ({marks})"
        found.update((f.id, f) for f in map(_row, await fetch_all(conn, sql, (org_id, now, *chunk))))
    return found


async def list_page(
    conn: aiosqlite.Connection, org_id: str, now: float, query: FileQuery
) -> tuple[list[StoredFile], bool]:
    """A page ordered by (created_at, id), newest first unless `query.ascending`."""
    where, params = _LIVE, [org_id, now]
    if query.purpose is not None:
        where += " AND purpose = ?"
        params.append(query.purpose)
    op, order = (">", "ASC") if query.ascending else ("<", "DESC")
    if query.after is not None:
        cursor_file = await get(conn, org_id, query.after, now)
        if cursor_file is None:
            return [], False
        where += f" AND (created_at {op} ? OR (created_at = ? AND id {op} ?))"
        params += [cursor_file.created_at, cursor_file.created_at, cursor_file.id]
    rows = await fetch_all(
        conn,
        f"SELECT {_COLUMNS} FROM files WHERE {where} ORDER BY created_at {order}, id {order} LIMIT ?",
        (*params, query.limit + 1),
    )
    return [_row(r) for r in rows[: query.limit]], len(rows) > query.limit


async def delete(conn: aiosqlite.Connection, org_id: str, file_id: str) -> bool:
    cursor = await conn.execute("DELETE FROM files WHERE org_id = ? AND id = ?", (org_id, file_id))
    return cursor.rowcount > 0


async def purge_expired(conn: aiosqlite.Connection, now: float) -> list[str]:
    """Delete rows past their expiry; returns their ids so that the caller removes the bytes."""
    rows = await fetch_all(
        conn, "DELETE FROM files WHERE expires_at IS NOT NULL AND expires_at <= ? RETURNING id", (now,)
    )
    return [r[0] for r in rows]


async def live_ids(conn: aiosqlite.Connection) -> set[str]:
    """Every file id with a row (orphan sweeps compare the folder with this)."""
    return {r[0] for r in await fetch_all(conn, "SELECT id FROM files")}
