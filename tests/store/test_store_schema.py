"""Startup: migrations, pragmas, integrity checks and refusing files we cannot trust."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from settings import StoreConfig
from store.schema import SCHEMA_VERSION, sqlite_version_is_safe
from store.store import Store
from store.types import Message, ShareSnapshot, StoreError
from tests.store.schema_helpers import drop_created_index, drop_search_index, drop_shares


def _schema(path: Path) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()


@pytest.mark.asyncio
async def test_migrations_run_once_and_reopening_changes_nothing(db_path: Path, store_config: StoreConfig) -> None:
    store = await Store.open(db_path, store_config)
    org = await store.create_org("acme", "plus")
    await store.close()
    before = _schema(db_path)

    store = await Store.open(db_path, store_config)
    assert (await store.get_org("acme")) == org
    await store.close()

    assert _schema(db_path) == before
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert {"orgs", "api_keys", "conversations", "messages", "usage"} <= {row[1] for row in before}


@pytest.mark.asyncio
async def test_open_sets_wal_full_sync_foreign_keys_and_read_only_readers(store: Store) -> None:
    writer = store._write_conn
    assert (await writer.execute_fetchall("PRAGMA journal_mode"))[0][0] == "wal"
    assert (await writer.execute_fetchall("PRAGMA synchronous"))[0][0] == 2  # FULL
    assert (await writer.execute_fetchall("PRAGMA foreign_keys"))[0][0] == 1
    assert (await writer.execute_fetchall("PRAGMA busy_timeout"))[0][0] == 2000
    reader = store._read_conns[0]
    with pytest.raises(sqlite3.OperationalError):
        await reader.execute("INSERT INTO meta (key, value) VALUES ('x', 'y')")


@pytest.mark.asyncio
async def test_synchronous_follows_config_and_rejects_unknown_modes(db_path: Path) -> None:
    store = await Store.open(db_path, StoreConfig(synchronous="normal"))
    assert (await store._write_conn.execute_fetchall("PRAGMA synchronous"))[0][0] == 1  # NORMAL
    await store.close()
    with pytest.raises(StoreError, match="synchronous"):
        await Store.open(db_path, StoreConfig(synchronous="sometimes"))


@pytest.mark.asyncio
async def test_a_database_from_a_newer_server_is_refused(db_path: Path, store_config: StoreConfig) -> None:
    await (await Store.open(db_path, store_config)).close()
    with sqlite3.connect(db_path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer"):
        await Store.open(db_path, store_config)


@pytest.mark.asyncio
async def test_a_file_that_is_not_a_database_is_refused(db_path: Path, store_config: StoreConfig) -> None:
    db_path.write_bytes(b"this is not an sqlite file at all" * 200)
    with pytest.raises(StoreError, match="cannot open"):
        await Store.open(db_path, store_config)


@pytest.mark.asyncio
async def test_another_programs_sqlite_file_is_refused_untouched(db_path: Path, store_config: StoreConfig) -> None:
    with sqlite3.connect(db_path) as conn:
        conn.execute("CREATE TABLE notes (x)")
    before = _schema(db_path)
    with pytest.raises(StoreError) as raised:
        await Store.open(db_path, store_config)
    assert str(raised.value) == (
        f"{db_path} is not this server's database (it has tables: notes);"
        " give --db a new path or this server's database"
    )
    assert _schema(db_path) == before  # no migration beside its tables
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # nor WAL


@pytest.mark.asyncio
async def test_a_folder_or_a_path_through_a_file_is_refused_in_one_line(
    tmp_path: Path, store_config: StoreConfig
) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        StoreError, match=f"^{re.escape(f'cannot open the database {tmp_path}: Is a directory')}; give a file in it"
    ):
        await Store.open(tmp_path, store_config)
    with pytest.raises(StoreError, match=r"Not a directory \(.*/file is a file\)$"):
        await Store.open(tmp_path / "file" / "chat.db", store_config)


@pytest.mark.asyncio
async def test_integrity_check_reports_ok_on_a_healthy_file(store: Store) -> None:
    await store.create_org("acme", "plus")
    assert await store.integrity_check() == "ok"


def test_sqlite_versions_below_3_52_are_flagged_unsafe() -> None:
    assert not sqlite_version_is_safe("3.40.1")
    assert not sqlite_version_is_safe("3.51.2")
    assert sqlite_version_is_safe("3.52.0")
    assert sqlite_version_is_safe("3.100.0")


@pytest.mark.asyncio
async def test_keys_made_before_scopes_existed_serve_inference_after_the_upgrade(
    db_path: Path, store_config: StoreConfig
) -> None:
    store = await Store.open(db_path, store_config)
    await store.create_org("acme", "plus")
    _key, secret = await store.create_key("acme")
    await store.close()
    with sqlite3.connect(db_path) as conn:  # the file as schema 7 left it
        conn.execute("ALTER TABLE api_keys DROP COLUMN scope")
        conn.execute("ALTER TABLE conversations DROP COLUMN pending")  # schema 9
        conn.execute("ALTER TABLE usage DROP COLUMN reasoning_tokens")  # schema 11
        conn.execute("ALTER TABLE usage DROP COLUMN fallback_reason")  # schema 12
        conn.execute("ALTER TABLE usage DROP COLUMN history_messages_dropped")
        conn.execute("ALTER TABLE conversations DROP COLUMN metadata_json")  # schema 10
        drop_shares(conn)  # schema 15
        drop_created_index(conn)  # schema 14
        drop_search_index(conn)  # schema 13
        conn.execute("PRAGMA user_version = 7")

    store = await Store.open(db_path, store_config)
    try:
        principal = await store.authenticate(secret)
        assert principal is not None and principal.scope == "inference" and not principal.is_admin
        assert [k.scope for k in await store.list_keys("acme")] == ["inference"]
        with pytest.raises(ValueError, match="scope"):
            await store.create_key("acme", scope="root")
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_a_schema_13_file_gets_the_creation_order_index_and_exports_as_before(
    db_path: Path, store_config: StoreConfig
) -> None:
    store = await Store.open(db_path, store_config)
    org = await store.create_org("acme", "plus")
    made = [await store.create_conversation(org.id, title=f"c{i}") for i in range(3)]
    await store.close()
    with sqlite3.connect(db_path) as conn:
        drop_shares(conn)
        drop_created_index(conn)
        conn.execute("PRAGMA user_version = 13")

    store = await Store.open(db_path, store_config)
    try:
        assert [c.id for c in await store.list_conversations_created(org.id, limit=10)] == [c.id for c in made[::-1]]
    finally:
        await store.close()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'conversations_created'").fetchone()


@pytest.mark.asyncio
async def test_a_schema_14_file_gets_the_shares_table_and_its_conversations_can_be_shared(
    db_path: Path, store_config: StoreConfig
) -> None:
    store = await Store.open(db_path, store_config)
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id, messages=(Message("msg_old", "user", "from before", 1.0),))
    await store.close()
    with sqlite3.connect(db_path) as conn:
        drop_shares(conn)
        conn.execute("PRAGMA user_version = 14")

    store = await Store.open(db_path, store_config)
    try:
        snapshot = ShareSnapshot(conv.title, 1, "msg_old", '{"messages": []}', 2.0)
        share = await store.create_share(org.id, conv.id, snapshot)
        assert share is not None and await store.shared_snapshot(share.token) == snapshot.snapshot_json
        assert await store.conversation_bytes(org.id) == len("from before") + len(snapshot.snapshot_json)
    finally:
        await store.close()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 15
