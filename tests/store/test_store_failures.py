"""A database that cannot be written: clear StoreUnavailable, is_writable, nothing acknowledged lost."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

import pytest
import structlog

from settings import StoreConfig
from store.store import Store
from store.types import StoreUnavailable

pytestmark = pytest.mark.asyncio


def _request_ids(db_path: Path) -> set[str]:
    with sqlite3.connect(db_path) as conn:
        return {row[0] for row in conn.execute("SELECT request_id FROM usage")}


async def test_a_full_disk_raises_store_unavailable_and_loses_nothing_acknowledged(db_path: Path, make_record) -> None:
    store = await Store.open(db_path, StoreConfig(max_db_bytes=512 * 1024))  # room for the write probe
    assert store.is_writable
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id)
    acknowledged: set[str] = set()
    failed = None
    with structlog.testing.capture_logs() as logs:
        for _ in range(200):
            rec = make_record(org.id, conversation_id=conv.id, assistant_content="x" * 8000)
            try:
                assert await store.record_request(rec) is True
            except StoreUnavailable:
                failed = rec
                break
            acknowledged.add(rec.request_id)
    assert failed is not None, "the size limit was never reached"
    assert not store.is_writable
    assert await store.get_org("acme") == org  # reads still work
    lost = [e for e in logs if e["event"] == "usage_record_not_written"]
    assert [e["request_id"] for e in lost] == [failed.request_id]  # reported, not silent
    await store.close()

    assert _request_ids(db_path) == acknowledged
    reopened = await Store.open(db_path, StoreConfig())  # the disk has room again
    try:
        assert reopened.is_writable
        assert await reopened.integrity_check() == "ok"
        assert await reopened.record_request(failed) is True  # a retry bills it once
    finally:
        await reopened.close()


async def test_a_locked_database_is_unavailable_until_the_lock_goes_then_recovers(db_path: Path, make_record) -> None:
    store = await Store.open(db_path, StoreConfig(busy_timeout_ms=100))
    org = await store.create_org("acme", "plus")
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        with pytest.raises(StoreUnavailable):
            await store.record_request(make_record(org.id))
        assert not store.is_writable
        assert (await store.list_orgs()) == [org]  # WAL readers are not blocked
    finally:
        other.execute("ROLLBACK")
        other.close()

    assert await store.probe_writable() is True
    rec = make_record(org.id)
    assert await store.record_request(rec) is True
    assert store.is_writable
    await store.close()
    assert _request_ids(db_path) == {rec.request_id}


async def test_close_finishes_every_queued_write(db_path: Path, make_record) -> None:
    store = await Store.open(db_path, StoreConfig())
    org = await store.create_org("acme", "plus")
    records = [make_record(org.id) for _ in range(50)]
    tasks = [asyncio.create_task(store.record_request(r)) for r in records]
    await asyncio.sleep(0)  # all enqueued
    await store.close()
    assert all(t.result() is True for t in tasks)
    assert _request_ids(db_path) == {r.request_id for r in records}


async def test_writes_and_reads_after_close_are_unavailable(db_path: Path, make_record) -> None:
    store = await Store.open(db_path, StoreConfig())
    org = await store.create_org("acme", "plus")
    await store.close()
    with pytest.raises(StoreUnavailable):
        await store.record_request(make_record(org.id))
    with pytest.raises(StoreUnavailable):
        await store.get_org("acme")
    await store.close()  # idempotent


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write a read-only file")
async def test_a_read_only_file_opens_for_reading_and_reports_unwritable(db_path: Path, make_record) -> None:
    store = await Store.open(db_path, StoreConfig())
    org = await store.create_org("acme", "plus")
    await store.close()
    db_path.chmod(0o444)
    store = await Store.open(db_path, StoreConfig())
    try:
        assert not store.is_writable
        assert await store.get_org("acme") == org
        with pytest.raises(StoreUnavailable):
            await store.record_request(make_record(org.id))
    finally:
        await store.close()


async def test_the_write_probe_fails_while_an_answer_sized_write_would_fail(db_path: Path, make_record) -> None:
    """/ready reads is_writable: a tiny in-place update succeeding must not turn it green."""
    store = await Store.open(db_path, StoreConfig(max_db_bytes=512 * 1024))
    try:
        org = await store.create_org("acme", "plus")
        conv = await store.create_conversation(org.id)
        with pytest.raises(StoreUnavailable):
            for _ in range(200):
                await store.record_request(make_record(org.id, conversation_id=conv.id, assistant_content="x" * 8000))
        assert not store.is_writable
        assert await store.probe_writable() is False
        assert not store.is_writable
    finally:
        await store.close()


async def test_a_disk_with_almost_no_room_left_is_unwritable_whatever_the_probe_fits_in(
    db_path: Path, monkeypatch
) -> None:
    """A probe can fit in pages the file or its WAL already hold on a full disk: the server
    started 'ready' and the first answer's write failed. The free space decides first."""
    import shutil

    from store import store as store_module

    real = shutil.disk_usage
    free = {"bytes": 1000}
    monkeypatch.setattr(store_module.shutil, "disk_usage", lambda p: real(p)._replace(free=free["bytes"]))
    store = await Store.open(db_path, StoreConfig())
    try:
        assert not store.is_writable  # /ready says so from the start
        free["bytes"] = store_module.MIN_FREE_BYTES  # room again: the maintenance probe recovers
        assert await store.probe_writable() is True and store.is_writable
    finally:
        await store.close()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_database_file_deleted_or_replaced_under_the_server_makes_it_unwritable_for_good(
    db_path: Path, make_record, how: str
) -> None:
    """Writes kept succeeding into the unlinked file and /ready stayed green: everything written
    after it was lost at stop, and keys made meanwhile went to a new file the server never read."""
    store = await Store.open(db_path, StoreConfig())
    try:
        org = await store.create_org("acme", "plus")
        os.unlink(db_path)
        if how == "replaced":
            sqlite3.connect(db_path).close()
        with structlog.testing.capture_logs() as logs:
            assert await store.probe_writable() is False
            assert await store.record_request(make_record(org.id)) is True  # the writer still commits...
            assert not store.is_writable  # ...but /ready and admission say the store is gone
            assert await store.probe_writable() is False
        gone = [e for e in logs if e["event"] == "store_file_gone"]
        assert len(gone) == 1 and gone[0]["problem"].startswith(how)
    finally:
        await store.close()
