"""Reading rows: aiosqlite's `execute_fetchall`, typed as the list of rows it returns.

aiosqlite declares an `Iterable[Row]`; every reader in the store indexes or measures the
result, so this one helper states what it is. It only reads: writes go through store.writer.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import Any

import aiosqlite


async def fetch_all(conn: aiosqlite.Connection, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
    return list(await conn.execute_fetchall(sql, params))
