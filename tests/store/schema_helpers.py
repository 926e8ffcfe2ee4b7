"""Turning a database back into the file an older schema left, for the migration tests."""

from __future__ import annotations

import sqlite3


def drop_search_index(conn: sqlite3.Connection) -> None:
    """Schema 13's objects gone (the FTS5 indexes, with their shadow tables, and their triggers):
    the file as schema 12 left it. Sets no user_version: the caller names the schema it wants."""
    triggers = [
        r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger' AND name LIKE '%_search_%'")
    ]
    for name in triggers:
        conn.execute(f"DROP TRIGGER {name}")
    for table in ("message_search", "title_search"):
        conn.execute(f"DROP TABLE {table}")
    left = conn.execute("SELECT name FROM sqlite_master WHERE name LIKE '%search%'").fetchall()
    assert not left, left


def drop_created_index(conn: sqlite3.Connection) -> None:
    """Schema 14's index gone: the file as schema 13 left it (no user_version set, as above)."""
    conn.execute("DROP INDEX conversations_created")


def drop_shares(conn: sqlite3.Connection) -> None:
    """Schema 15's share links gone (the table and its indexes): the file as schema 14 left it (no
    user_version set, as above)."""
    conn.execute("DROP TABLE shares")
    left = conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'shares%'").fetchall()
    assert not left, left
