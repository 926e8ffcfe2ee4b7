"""The schema as numbered migrations, and the pragmas every connection gets.

`migrate` brings a database to the newest version recorded in `PRAGMA user_version`, each
migration in its own transaction. Migrations are append-only: never edit one that shipped.
"""

from __future__ import annotations

import sqlite3

import aiosqlite
import structlog

from store.rows import fetch_all
from store.types import StoreError

log = structlog.get_logger(__name__)

# SQLite's WAL docs list a WAL-reset corruption bug in 3.7.0 to 3.51.2, fixed in 3.52.0.
MIN_SAFE_SQLITE = (3, 52, 0)
SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")

_V1 = """
CREATE TABLE orgs (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    tier        TEXT NOT NULL,
    budget_usd  REAL,                       -- per calendar month (UTC); NULL: no budget
    limits_json TEXT NOT NULL DEFAULT '{}', -- per-org overrides of tier limits
    created_at  REAL NOT NULL
) STRICT;

CREATE TABLE api_keys (
    id           TEXT PRIMARY KEY,
    org_id       TEXT NOT NULL REFERENCES orgs(id),
    key_hash     TEXT NOT NULL UNIQUE,      -- hex SHA-256 of the secret; the secret is never stored
    prefix       TEXT NOT NULL UNIQUE,
    last4        TEXT NOT NULL,
    name         TEXT,
    created_at   REAL NOT NULL,
    last_used_at REAL,
    revoked_at   REAL
) STRICT;
CREATE INDEX api_keys_org ON api_keys(org_id);

CREATE TABLE conversations (
    id         TEXT PRIMARY KEY,
    org_id     TEXT NOT NULL REFERENCES orgs(id),
    title      TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    deleted_at REAL                         -- soft delete; purged after the tier's retention
) STRICT;
CREATE INDEX conversations_live ON conversations(org_id, updated_at DESC, id DESC)
    WHERE deleted_at IS NULL;
CREATE INDEX conversations_deleted ON conversations(deleted_at) WHERE deleted_at IS NOT NULL;

CREATE TABLE messages (
    id              TEXT PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    seq             INTEGER NOT NULL,       -- 0-based position; only tails are ever deleted
    role            TEXT NOT NULL,
    content         TEXT NOT NULL,
    created_at      REAL NOT NULL,
    tokens          INTEGER,
    model           TEXT,
    request_id      TEXT,
    UNIQUE (conversation_id, seq)
) STRICT;

-- The ledger outlives keys and purged conversations, so conversation_id has no foreign key.
CREATE TABLE usage (
    request_id        TEXT PRIMARY KEY,     -- unique: a request is never billed twice
    org_id            TEXT NOT NULL REFERENCES orgs(id),
    key_id            TEXT REFERENCES api_keys(id),
    model             TEXT NOT NULL,
    tier              TEXT NOT NULL,
    status            TEXT NOT NULL CHECK (status IN ('finished', 'aborted', 'error', 'filtered')),
    prompt_tokens     INTEGER NOT NULL CHECK (prompt_tokens >= 0),
    cached_tokens     INTEGER NOT NULL CHECK (cached_tokens >= 0),
    completion_tokens INTEGER NOT NULL CHECK (completion_tokens >= 0),
    cost_usd          REAL NOT NULL,
    queue_ms          REAL,
    ttft_ms           REAL,
    total_ms          REAL,
    created_at        REAL NOT NULL,
    finished_at       REAL NOT NULL,
    conversation_id   TEXT,
    fallback_from     TEXT
) STRICT;
CREATE INDEX usage_org_created ON usage(org_id, created_at);

-- Spend per organisation and calendar month, kept in the ledger's transaction so that the
-- budget check at admission is one lookup.
CREATE TABLE org_month_spend (
    org_id   TEXT NOT NULL REFERENCES orgs(id),
    month    TEXT NOT NULL,                 -- 'YYYY-MM', UTC
    cost_usd REAL NOT NULL,
    PRIMARY KEY (org_id, month)
) STRICT, WITHOUT ROWID;

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT
) STRICT;
"""

# Uploaded files (#20): metadata and owner here, the bytes on disk by id. A message keeps the
# parts it was sent with (file ids, image refs) so that a conversation shows its attachments
# and re-renders the same prompt on the next turn.
_V2_FILES = """
CREATE TABLE files (
    id         TEXT PRIMARY KEY,
    org_id     TEXT NOT NULL REFERENCES orgs(id),
    filename   TEXT NOT NULL,
    purpose    TEXT NOT NULL,
    bytes      INTEGER NOT NULL CHECK (bytes >= 0),
    sha256     TEXT NOT NULL,
    media_type TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL                         -- NULL: kept until deleted
) STRICT;
CREATE INDEX files_org ON files(org_id, created_at DESC, id DESC);
CREATE INDEX files_expiry ON files(expires_at) WHERE expires_at IS NOT NULL;
ALTER TABLE messages ADD COLUMN parts_json TEXT;  -- NULL: text only
"""

# Who counted a ledger row's tokens: 'engine' (this process), 'upstream' (the usage an
# upstream server reported), 'tokenizer' (our recount with the local tokenizer), 'estimate'.
_V3_USAGE_SOURCE = """
ALTER TABLE usage ADD COLUMN usage_source TEXT NOT NULL DEFAULT 'engine'
    CHECK (usage_source IN ('engine', 'upstream', 'tokenizer', 'estimate'));
"""

_V4_FEEDBACK = """
ALTER TABLE messages ADD COLUMN finish_reason TEXT;  -- assistant messages: stop, length, content_filter
-- What users said about answers, for evaluation and tuning. Prompt and answer are copied, so
-- the row outlives a regenerated or edited turn (which truncates the messages it rates).
CREATE TABLE feedback (
    message_id      TEXT PRIMARY KEY,       -- the assistant message rated
    org_id          TEXT NOT NULL REFERENCES orgs(id),
    conversation_id TEXT NOT NULL,
    model           TEXT,
    prompt          TEXT NOT NULL,          -- the user message it answered
    answer          TEXT NOT NULL,
    rating          INTEGER CHECK (rating IN (-1, 1)),  -- thumbs down / up; NULL: none
    comment         TEXT,
    regenerated     INTEGER NOT NULL DEFAULT 0 CHECK (regenerated IN (0, 1)),
    edited_prompt   TEXT,                   -- the user's rewrite of the prompt; NULL: not edited
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL
) STRICT;
CREATE INDEX feedback_org_updated ON feedback(org_id, updated_at);
"""

# Responses API (#17): a stored response is a turn of a conversation (the web UI lists it);
# this row keeps the response object as returned and the input items it was asked with.
_V5_RESPONSES = """
CREATE TABLE responses (
    id               TEXT PRIMARY KEY,
    org_id           TEXT NOT NULL REFERENCES orgs(id),
    conversation_id  TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    num_messages     INTEGER NOT NULL,   -- the conversation's messages once this response was written
    body_json        TEXT NOT NULL,      -- the response object
    input_items_json TEXT NOT NULL,      -- the input items, as listed by /input_items
    created_at       REAL NOT NULL
) STRICT;
CREATE INDEX responses_conversation ON responses(conversation_id);
"""

# API keys that stop working at a set time (`keys create --expires-in-days N`).
_V6_KEY_EXPIRY = """
ALTER TABLE api_keys ADD COLUMN expires_at REAL;  -- NULL: never expires
"""

# Background responses (#17): their status lives in the row too, so that a restart can find the
# ones a previous process left queued or in progress (and mark them failed) without a scan.
_V7_RESPONSE_STATUS = """
ALTER TABLE responses ADD COLUMN status TEXT NOT NULL DEFAULT 'completed';
CREATE INDEX responses_unfinished ON responses(status) WHERE status IN ('queued', 'in_progress');
"""

# Admin keys (`keys create --scope admin`): they manage organisations, keys and usage over
# /v1/admin/ and are refused everywhere else; every older key serves inference as before.
_V8_KEY_SCOPE = """
ALTER TABLE api_keys ADD COLUMN scope TEXT NOT NULL DEFAULT 'inference' CHECK (scope IN ('inference', 'admin'));
"""

# A conversation a Responses call creates is `pending` until its first turn is stored; one
# still pending at startup was cut by a crash (kill -9, power loss) and is deleted then.
_V9_PENDING_CONVERSATIONS = """
ALTER TABLE conversations ADD COLUMN pending INTEGER NOT NULL DEFAULT 0 CHECK (pending IN (0, 1));
"""

# OpenAI's `metadata` on a conversation (POST /v1/conversations): at most 16 string pairs, as JSON.
_V10_CONVERSATION_METADATA = """
ALTER TABLE conversations ADD COLUMN metadata_json TEXT;  -- NULL: none
"""

# Of a request's completion tokens, how many a reasoning model spent thinking (OpenAI's
# completion_tokens_details.reasoning_tokens), so a stored answer can say it after a reload.
_V11_REASONING_TOKENS = """
ALTER TABLE usage ADD COLUMN reasoning_tokens INTEGER NOT NULL DEFAULT 0 CHECK (reasoning_tokens >= 0);
"""

# Why another model answered (busy, unavailable, over_budget) and how many of a stored
# conversation's oldest messages the prompt left out to fit the context: what the web UI
# says beside an answer, kept so that it still says it after a reload.
_V12_ANSWER_NOTES = """
ALTER TABLE usage ADD COLUMN fallback_reason TEXT;
ALTER TABLE usage ADD COLUMN history_messages_dropped INTEGER NOT NULL DEFAULT 0 CHECK (history_messages_dropped >= 0);
"""

# Search (GET /v1/conversations?q=): FTS5 indexes of message text and titles, kept by triggers,
# so that every write path (a turn, a branch's copy, a truncated tail, a rename, a purge or a
# pending conversation discarded: messages go by ON DELETE CASCADE, which fires their trigger)
# updates them in its own transaction. External content: the text stays in `messages` and
# `conversations`, the index holds only its trigrams, keyed by the row's rowid (the store never
# VACUUMs, which may renumber rowids; `backup` copies pages). The indexes span every
# organisation: store/search.py scopes each query by joining `conversations` on org_id and
# deleted_at, as every read does; a soft-deleted conversation leaves the index when purged.
#
# Trigram, not unicode61 words with prefix queries: the text is found as a substring,
# case-insensitively (non-ASCII letters too), in any script (CJK has no spaces for unicode61 to
# split words at), as "contains the text" promises. Text of 1-2 characters has no trigram:
# store/search.py looks for it in titles only. The price is size, measured with
# bench/bench_search.py (bench/RESULTS.md, "Conversation search"): 2,000 conversations of 10
# messages, 6.6 M characters of text (a 9.1 MB messages table), took a 20.7 MB trigram index
# (3.1 bytes a character); unicode61 would take 3.4 MB, trigram with detail=column (no phrase
# queries, so no substring check) 15.3 MB. Titles add 0.4 MB.
_V13_SEARCH = """
CREATE VIRTUAL TABLE message_search USING fts5(content, content='messages', tokenize='trigram');
CREATE VIRTUAL TABLE title_search USING fts5(title, content='conversations', tokenize='trigram');
CREATE TRIGGER message_search_insert AFTER INSERT ON messages BEGIN
    INSERT INTO message_search (rowid, content) VALUES (new.rowid, new.content);
END;
CREATE TRIGGER message_search_delete AFTER DELETE ON messages BEGIN
    INSERT INTO message_search (message_search, rowid, content) VALUES ('delete', old.rowid, old.content);
END;
CREATE TRIGGER message_search_update AFTER UPDATE OF content ON messages BEGIN
    INSERT INTO message_search (message_search, rowid, content) VALUES ('delete', old.rowid, old.content);
    INSERT INTO message_search (rowid, content) VALUES (new.rowid, new.content);
END;
CREATE TRIGGER title_search_insert AFTER INSERT ON conversations BEGIN
    INSERT INTO title_search (rowid, title) VALUES (new.rowid, new.title);
END;
CREATE TRIGGER title_search_delete AFTER DELETE ON conversations BEGIN
    INSERT INTO title_search (title_search, rowid, title) VALUES ('delete', old.rowid, old.title);
END;
CREATE TRIGGER title_search_update AFTER UPDATE OF title ON conversations WHEN old.title IS NOT new.title BEGIN
    INSERT INTO title_search (title_search, rowid, title) VALUES ('delete', old.rowid, old.title);
    INSERT INTO title_search (rowid, title) VALUES (new.rowid, new.title);
END;
-- Existing databases: index what is there already.
INSERT INTO message_search (message_search) VALUES ('rebuild');
INSERT INTO title_search (title_search) VALUES ('rebuild');
"""

# The export (api/export.py) reads an organisation's conversations newest created first, a page
# at a time by (created_at, id); without this index each page sorted all of them again.
_V14_CREATED_ORDER = """
CREATE INDEX conversations_created ON conversations(org_id, created_at DESC, id DESC)
    WHERE deleted_at IS NULL;
"""

# Share links (api/shares.py): a read-only snapshot of a conversation, reachable without a key by
# its link's token. The snapshot is a copy (the public JSON as it is served), so later turns,
# edits and regenerations never change what a link shows; its text counts against the tier's
# conversation storage (store/conversations.py, stored_bytes). A revoked share's row is deleted,
# and so are a conversation's shares when it is deleted (soft_delete) or purged (the cascade).
_V15_SHARES = """
CREATE TABLE shares (
    id              TEXT PRIMARY KEY,       -- share_<hex>: names it to its organisation (list, update, revoke)
    token           TEXT NOT NULL UNIQUE,   -- the link's secret (secrets, 192 bits); never derived from an id
    org_id          TEXT NOT NULL REFERENCES orgs(id),
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    title           TEXT,                   -- the conversation's title when the snapshot was taken
    num_messages    INTEGER NOT NULL CHECK (num_messages >= 0),  -- the conversation's messages it covers
    last_message_id TEXT NOT NULL,          -- the last of them
    snapshot_json   TEXT NOT NULL,          -- GET /v1/shared/{token}'s body
    created_at      REAL NOT NULL,
    snapshot_at     REAL NOT NULL           -- when the snapshot was taken (again, by an update)
) STRICT;
CREATE INDEX shares_org ON shares(org_id, created_at DESC, id DESC);
CREATE INDEX shares_conversation ON shares(conversation_id);
"""

# (version, script); version N leaves `PRAGMA user_version = N`.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, _V1),
    (2, _V2_FILES),
    (3, _V3_USAGE_SOURCE),
    (4, _V4_FEEDBACK),
    (5, _V5_RESPONSES),
    (6, _V6_KEY_EXPIRY),
    (7, _V7_RESPONSE_STATUS),
    (8, _V8_KEY_SCOPE),
    (9, _V9_PENDING_CONVERSATIONS),
    (10, _V10_CONVERSATION_METADATA),
    (11, _V11_REASONING_TOKENS),
    (12, _V12_ANSWER_NOTES),
    (13, _V13_SEARCH),
    (14, _V14_CREATED_ORDER),
    (15, _V15_SHARES),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]
_V1_TABLES = ("orgs", "api_keys", "conversations", "messages", "usage", "org_month_spend", "meta")


def sqlite_version_is_safe(version: str = sqlite3.sqlite_version) -> bool:
    return tuple(int(p) for p in version.split(".")[:3]) >= MIN_SAFE_SQLITE


async def configure(conn: aiosqlite.Connection, *, busy_timeout_ms: int, is_reader: bool) -> None:
    """Per-connection pragmas. The writer sets journal_mode and synchronous in `prepare`."""
    conn.row_factory = sqlite3.Row
    # execute_fetchall, not execute: a pragma's unread result row would keep a statement open.
    await conn.execute_fetchall(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    await conn.execute_fetchall("PRAGMA foreign_keys = ON")
    if is_reader:
        await conn.execute_fetchall("PRAGMA query_only = ON")  # a read connection can never write


async def prepare(conn: aiosqlite.Connection, synchronous: str) -> None:
    """Run once on the write connection at startup: WAL, synchronous, quick_check, migrations."""
    mode = synchronous.upper()
    if mode not in SYNCHRONOUS_MODES:
        raise StoreError(f"store.synchronous must be one of {SYNCHRONOUS_MODES}, got {synchronous!r}")
    await _check_is_ours(conn)  # before WAL, which another program's file would keep
    journal = await _scalar(conn, "PRAGMA journal_mode = WAL")
    if str(journal).lower() != "wal":
        raise StoreError(f"could not switch the database to WAL (journal_mode is {journal!r})")
    # FULL by default: in WAL mode it syncs the log on every commit, so an acknowledged ledger
    # row survives power loss; NORMAL would survive a process crash but may lose the last commits.
    await conn.execute_fetchall(f"PRAGMA synchronous = {mode}")
    await conn.execute_fetchall("PRAGMA journal_size_limit = 67108864")  # truncate the WAL after a burst
    check = await _scalar(conn, "PRAGMA quick_check")
    if check != "ok":
        raise StoreError(f"the database failed quick_check: {check}")
    await migrate(conn)


async def migrate(conn: aiosqlite.Connection) -> int:
    """Apply every migration newer than the file's user_version; returns the new version."""
    user_version = await _scalar(conn, "PRAGMA user_version")
    current = user_version if isinstance(user_version, int) else 0
    if current > SCHEMA_VERSION:
        raise StoreError(f"the database is at schema {current}, newer than this server's {SCHEMA_VERSION}")
    for version, script in MIGRATIONS:
        if version <= current:
            continue
        try:  # the whole migration and its version bump commit together, or not at all
            await conn.executescript(f"BEGIN IMMEDIATE;\n{script}\nPRAGMA user_version = {version};\nCOMMIT;")
        except sqlite3.Error:
            if conn.in_transaction:
                await conn.execute("ROLLBACK")
            raise
        log.info("store_migrated", schema_version=version)
        current = version
    return current


async def _check_is_ours(conn: aiosqlite.Connection) -> None:
    """Refuse another program's SQLite file: tables but no schema version of ours, or a version
    without the tables it implies. Migrating it would add our tables beside its own."""
    version = await _scalar(conn, "PRAGMA user_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        return  # a newer server's: `migrate` says so
    rows = await fetch_all(conn, "SELECT name FROM sqlite_master WHERE type = 'table'")
    tables = sorted(name for name in (str(r[0]) for r in rows) if not name.startswith("sqlite_"))  # not SQLite's own
    if (not version and not tables) or (version and all(t in tables for t in _V1_TABLES)):
        return
    path = next((str(r[2]) for r in await fetch_all(conn, "PRAGMA database_list") if r[1] == "main"), "the file")
    has = f"it has tables: {', '.join(tables)}" if tables else "it has no tables"
    raise StoreError(f"{path} is not this server's database ({has}); give --db a new path or this server's database")


async def _scalar(conn: aiosqlite.Connection, sql: str) -> object:
    rows = await fetch_all(conn, sql)
    return rows[0][0] if rows else None
