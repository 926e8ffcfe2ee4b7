"""SQL for organisations and API keys.

Write functions take the writer's connection inside its transaction; read functions take a
read connection. A key's secret exists only in `new_secret`'s return value: the database keeps
its SHA-256, a display prefix and the last four characters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
import sqlite3
import time
from typing import Any

import aiosqlite
import orjson

from store.keycache import LiveKey
from store.rows import fetch_all
from store.types import INFERENCE_SCOPE, KEY_SCOPES, ApiKey, Conflict, NotFound, Org, Principal

SECRET_PREFIX = "sk-"
MAX_LOOKUP_HASHES = 500  # per query: SQLite's host-parameter limit is 999 on older builds
PREFIX_CHARS = 11  # "sk-" plus 8 random characters (48 bits): unique in practice, checked anyway
MIN_PREFIX_MATCH_CHARS = 6  # "sk-" plus 3: the least of a listed prefix that `find_keys` matches on
MAX_SECRET_CHARS = 256  # longer strings are not ours; refuse before hashing them
# Limits the CLI and the admin API both check before writing anything:
MAX_ORG_NAME_CHARS = 100  # one column of `keys list`, one field of every log line
MAX_BUDGET_USD = 1e12  # per month; to the nano-dollar that is 22 digits, within Decimal's 28 (1e19 is not)
MAX_EXPIRES_IN_DAYS = 36_500.0  # 100 years: a later date does not fit a datetime

_ORG_COLUMNS = "o.id, o.name, o.tier, o.budget_usd, o.limits_json, o.created_at"
_KEY_COLUMNS = (
    "k.id, k.org_id, k.prefix, k.last4, k.name, k.created_at, k.last_used_at, k.revoked_at, k.expires_at, k.scope"
)


# A presented secret of "sk-" and at least this many URL-safe characters is taken for one of our
# keys (43 after "sk-"), mistyped or cut short included; shorter ones are placeholders.
_KEY_SHAPED_BODY_CHARS = 32


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def is_key_shaped(secret: str) -> bool:
    """Whether `secret` has the shape of the keys this server makes ("sk-" and 43 URL-safe
    characters; from 32 on, so that a key mistyped or cut short still counts as one). What else
    clients send where a local server needs no key (vLLM's "EMPTY", llama.cpp's
    "sk-no-key-required", "ollama", "lm-studio") is a placeholder, not a key."""
    body = secret.removeprefix(SECRET_PREFIX)
    return (
        secret.startswith(SECRET_PREFIX)
        and len(body) >= _KEY_SHAPED_BODY_CHARS
        and body.isascii()
        and all(c.isalnum() or c in "-_" for c in body)
    )


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


MAX_KEY_NAME_CHARS = 200  # a key's label (`keys create --name`, the admin API's "name")


def is_well_formed(secret: str) -> bool:
    """Could be one of ours; anything else is refused without hashing or a lookup."""
    return secret.startswith(SECRET_PREFIX) and len(secret) <= MAX_SECRET_CHARS


def org_name_problem(name: str) -> str | None:
    """Why `name` cannot name a new organisation (blank, too long, a control character), or None."""
    if not name.strip():
        return "an organisation needs a name"
    if len(name) > MAX_ORG_NAME_CHARS:
        return f"an organisation's name is at most {MAX_ORG_NAME_CHARS} characters, got {len(name)}"
    if not name.isprintable():  # tabs and newlines would break `keys list`'s columns and rows
        return f"an organisation's name cannot hold tabs, newlines or other control characters, got {name!r}"
    return None


def key_name_problem(name: str) -> str | None:
    """Why `name` cannot label a key (too long, a control character), or None."""
    if len(name) > MAX_KEY_NAME_CHARS:
        return f"a key's name is at most {MAX_KEY_NAME_CHARS} characters, got {len(name)}"
    if not name.isprintable():  # as an organisation's: `keys list` prints it in a column
        return f"a key's name cannot hold tabs, newlines or other control characters, got {name!r}"
    return None


def stored_bound(value: float | None) -> float | None:
    """A stored expiry or budget as it acts: infinity (written before the limits above were checked)
    or NaN bounds nothing, so None, as a key that never expires and an organisation without a budget
    are shown (JSON has no Infinity, `keys list` said "expires after 9999-12-31"); minus infinity has
    passed, so 0."""
    if value is None or math.isfinite(value):
        return value
    return 0.0 if value < 0 else None


def org_from_row(row: sqlite3.Row | tuple[Any, ...], offset: int = 0) -> Org:
    id_, name, tier, budget, limits_json, created_at = tuple(row)[offset : offset + 6]
    return Org(id_, name, tier, stored_bound(budget), orjson.loads(limits_json), created_at)


def key_from_row(row: sqlite3.Row | tuple[Any, ...]) -> ApiKey:
    key = ApiKey(*tuple(row)[:10])
    return dataclasses.replace(key, expires_at=stored_bound(key.expires_at))


# --- reads ------------------------------------------------------------------------------


async def get_org(conn: aiosqlite.Connection, name: str) -> Org | None:
    rows = await fetch_all(conn, f"SELECT {_ORG_COLUMNS} FROM orgs o WHERE o.name = ?", (name,))
    return org_from_row(rows[0]) if rows else None


async def list_orgs(conn: aiosqlite.Connection) -> list[Org]:
    rows = await fetch_all(conn, f"SELECT {_ORG_COLUMNS} FROM orgs o ORDER BY o.name")
    return [org_from_row(r) for r in rows]


async def list_keys(conn: aiosqlite.Connection, org_name: str | None) -> list[ApiKey]:
    if org_name is None:
        rows = await fetch_all(conn, f"SELECT {_KEY_COLUMNS} FROM api_keys k ORDER BY k.created_at")
        return [key_from_row(r) for r in rows]
    if await get_org(conn, org_name) is None:
        raise NotFound(f"no organisation named {org_name!r}")
    rows = await fetch_all(
        conn,
        f"SELECT {_KEY_COLUMNS} FROM api_keys k JOIN orgs o ON o.id = k.org_id WHERE o.name = ? ORDER BY k.created_at",
        (org_name,),
    )
    return [key_from_row(r) for r in rows]


async def get_key(conn: aiosqlite.Connection, ident: str) -> ApiKey | None:
    """The key whose id (`key_...`) or prefix (`sk-...`) is `ident`, revoked or not."""
    sql = f"SELECT {_KEY_COLUMNS} FROM api_keys k WHERE k.id = ? OR k.prefix = ?"
    rows = await fetch_all(conn, sql, (ident, ident))
    return key_from_row(rows[0]) if rows else None


async def find_keys(conn: aiosqlite.Connection, ident: str) -> list[ApiKey]:
    """Keys whose id is `ident` or whose prefix starts with it, revoked or not, oldest first.
    A prefix needs MIN_PREFIX_MATCH_CHARS; shorter text matches ids only."""
    params: tuple[int | str, ...]
    if ident.startswith(SECRET_PREFIX) and len(ident) >= MIN_PREFIX_MATCH_CHARS:
        # substr, not LIKE: LIKE ignores case and reads "_" (a base64url character) as a wildcard.
        where, params = "substr(k.prefix, 1, ?) = ?", (len(ident), ident)
    else:
        where, params = "k.id = ?", (ident,)
    rows = await fetch_all(conn, f"SELECT {_KEY_COLUMNS} FROM api_keys k WHERE {where} ORDER BY k.created_at", params)
    return [key_from_row(r) for r in rows]


async def find_live_keys(conn: aiosqlite.Connection, key_hashes: list[str]) -> dict[str, LiveKey]:
    """hash -> LiveKey for each hash of a key that is not revoked (expiry is the caller's check)."""
    found: dict[str, LiveKey] = {}
    for start in range(0, len(key_hashes), MAX_LOOKUP_HASHES):
        batch = key_hashes[start : start + MAX_LOOKUP_HASHES]
        rows = await fetch_all(
            conn,
            f"SELECT k.key_hash, k.id, k.expires_at, k.scope, {_ORG_COLUMNS}"
            " FROM api_keys k JOIN orgs o ON o.id = k.org_id"
            f" WHERE k.revoked_at IS NULL AND k.key_hash IN ({', '.join('?' * len(batch))})",
            batch,
        )
        for row in rows:
            key_hash, key_id, expires_at, scope = tuple(row)[:4]
            found[key_hash] = LiveKey(Principal(key_id, org_from_row(row, offset=4), scope), stored_bound(expires_at))
    return found


# --- writes (inside the writer's transaction) -------------------------------------------


async def insert_org(
    conn: aiosqlite.Connection, name: str, tier: str, budget_usd: float | None, limits: dict[str, Any]
) -> Org:
    org = Org(f"org_{secrets.token_hex(8)}", name, tier, budget_usd, dict(limits), time.time())
    try:
        await conn.execute(
            "INSERT INTO orgs (id, name, tier, budget_usd, limits_json, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (org.id, name, tier, budget_usd, orjson.dumps(org.limits).decode(), org.created_at),
        )
    except sqlite3.IntegrityError as exc:
        raise Conflict(f"an organisation named {name!r} already exists") from exc
    return org


async def update_org(conn: aiosqlite.Connection, name: str, changes: dict[str, Any]) -> Org:
    """`changes` holds only the fields to set: tier, budget_usd, limits."""
    columns = {"tier": "tier", "budget_usd": "budget_usd", "limits": "limits_json"}
    values = {columns[k]: (orjson.dumps(v).decode() if k == "limits" else v) for k, v in changes.items()}
    if values:
        assignments = ", ".join(f"{col} = ?" for col in values)
        await conn.execute(f"UPDATE orgs SET {assignments} WHERE name = ?", (*values.values(), name))
    org = await get_org(conn, name)
    if org is None:
        raise NotFound(f"no organisation named {name!r}")
    return org


async def ensure_org(conn: aiosqlite.Connection, name: str, tier: str) -> Org:
    org = await get_org(conn, name)
    if org is None:
        return await insert_org(conn, name, tier, None, {})
    if org.tier != tier:
        return await update_org(conn, name, {"tier": tier})
    return org


async def insert_key(
    conn: aiosqlite.Connection,
    org_name: str,
    name: str | None,
    expires_at: float | None = None,
    scope: str = INFERENCE_SCOPE,
) -> tuple[ApiKey, str]:
    if scope not in KEY_SCOPES:
        raise ValueError(f"a key's scope is one of {', '.join(KEY_SCOPES)}, not {scope!r}")
    org = await get_org(conn, org_name)
    if org is None:
        raise NotFound(f"no organisation named {org_name!r}")
    for _ in range(5):  # a prefix collision (48 bits) is all but impossible; retry if it happens
        secret = new_secret()
        key = ApiKey(
            f"key_{secrets.token_hex(8)}",
            org.id,
            secret[:PREFIX_CHARS],
            secret[-4:],
            name,
            time.time(),
            None,
            None,
            expires_at,
            scope,
        )
        try:
            await conn.execute(
                "INSERT INTO api_keys (id, org_id, key_hash, prefix, last4, name, created_at, expires_at, scope)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key.id,
                    key.org_id,
                    hash_secret(secret),
                    key.prefix,
                    key.last4,
                    name,
                    key.created_at,
                    expires_at,
                    scope,
                ),
            )
        except sqlite3.IntegrityError:
            continue
        return key, secret
    raise Conflict("could not draw a unique key prefix")


async def revoke_key(conn: aiosqlite.Connection, prefix: str, now: float) -> bool:
    """Revoke the live key named by its prefix (`sk-...`) or its id (`key_...`)."""
    cursor = await conn.execute(
        "UPDATE api_keys SET revoked_at = ? WHERE (prefix = ? OR id = ?) AND revoked_at IS NULL", (now, prefix, prefix)
    )
    return cursor.rowcount > 0


async def touch_keys(conn: aiosqlite.Connection, last_used: dict[str, float]) -> None:
    await conn.executemany(
        "UPDATE api_keys SET last_used_at = max(coalesce(last_used_at, 0), ?) WHERE id = ?",
        [(t, key_id) for key_id, t in last_used.items()],
    )
