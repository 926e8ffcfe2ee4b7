"""The usage ledger: exactly once, under concurrency and cancellation, and its summaries."""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
from pathlib import Path

import pytest

from store.store import Store
from store.types import RequestStatus

pytestmark = pytest.mark.asyncio


def _count(db_path: Path, sql: str, params: tuple = ()) -> int:
    with sqlite3.connect(db_path) as conn:
        return conn.execute(sql, params).fetchone()[0]


async def test_recording_a_request_twice_writes_one_row_and_one_turn(store: Store, db_path: Path, make_record) -> None:
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id)
    rec = make_record(org.id, conversation_id=conv.id, new_messages=(("user", "hi"),), assistant_content="hello")

    assert await store.record_request(rec) is True
    assert await store.record_request(rec) is False
    results = await asyncio.gather(*(store.record_request(rec) for _ in range(5)))
    assert results == [False] * 5

    assert _count(db_path, "SELECT count(*) FROM usage WHERE request_id = ?", (rec.request_id,)) == 1
    assert _count(db_path, "SELECT count(*) FROM messages") == 2
    assert await store.month_spend_usd(org.id) == pytest.approx(rec.cost_usd)


async def test_200_concurrent_records_all_land_without_busy_errors(store: Store, db_path: Path, make_record) -> None:
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id)
    records = [
        make_record(
            org.id,
            completion_tokens=i,
            cost_usd=i / 1000,
            conversation_id=conv.id if i % 4 == 0 else None,
            new_messages=(("user", f"q{i}"),),
            assistant_content=f"a{i}",
        )
        for i in range(200)
    ]
    results = await asyncio.gather(*(store.record_request(r) for r in records), return_exceptions=True)

    assert results == [True] * 200  # no exception, SQLITE_BUSY or otherwise, reached a caller
    assert _count(db_path, "SELECT count(*) FROM usage") == 200
    assert _count(db_path, "SELECT sum(completion_tokens) FROM usage") == sum(range(200))
    assert await store.month_spend_usd(org.id) == pytest.approx(sum(range(200)) / 1000)
    conv_full = await store.get_conversation(org.id, conv.id)
    assert conv_full is not None and len(conv_full.messages) == 2 * 50


async def test_a_cancelled_caller_leaves_no_open_transaction(store: Store, db_path: Path, make_record) -> None:
    org = await store.create_org("acme", "plus")
    recs = [make_record(org.id) for _ in range(20)]
    tasks = [asyncio.create_task(store.record_request(r)) for r in recs]
    await asyncio.sleep(0)  # enqueued, not yet committed
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    after = make_record(org.id)
    assert await store.record_request(after) is True  # the writer is not wedged
    assert not store._write_conn.in_transaction
    # Jobs already queued were still committed: a finished request is billed even if its
    # handler was cancelled.
    assert _count(db_path, "SELECT count(*) FROM usage") == 21
    with sqlite3.connect(db_path, timeout=0) as conn:  # and the write lock is free
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")


async def test_a_failing_job_does_not_undo_the_others_committed_with_it(
    store: Store, db_path: Path, make_record
) -> None:
    org = await store.create_org("acme", "plus")
    bad = make_record("org_missing")  # foreign key violation
    good = [make_record(org.id) for _ in range(3)]
    calls = [store.record_request(r) for r in [good[0], bad, *good[1:]]]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert results[0] is True and results[2:] == [True, True]
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert _count(db_path, "SELECT count(*) FROM usage") == 3
    assert store.is_writable


async def test_usage_summary_groups_by_model_day_and_key(store: Store, make_record) -> None:
    org = await store.create_org("acme", "plus")
    other = await store.create_org("other", "plus")
    key, _ = await store.create_key("acme")
    day1 = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC).timestamp()
    day2 = day1 + 86400
    for org_id, model, created_at, prompt_tokens, cost_usd, key_id in [
        (org.id, "a", day1, 10, 1.0, None),
        (org.id, "a", day2, 20, 2.0, key.id),
        (org.id, "b", day2, 40, 4.0, key.id),
        (other.id, "a", day1, 1000, 100.0, None),
    ]:
        rec = make_record(
            org_id,
            model=model,
            created_at=created_at,
            prompt_tokens=prompt_tokens,
            completion_tokens=prompt_tokens // 10,
            cost_usd=cost_usd,
            key_id=key_id,
            status=RequestStatus.ABORTED,
        )
        await store.record_request(rec)

    by_model = await store.usage_summary(org.id, group_by="model")
    assert [(r["model"], r["num_requests"], r["prompt_tokens"], r["completion_tokens"]) for r in by_model] == [
        ("a", 2, 30, 3),
        ("b", 1, 40, 4),
    ]
    by_day = await store.usage_summary(org.id, group_by="day")
    assert [(r["day"], r["cost_usd"]) for r in by_day] == [("2026-03-01", 1.0), ("2026-03-02", 6.0)]
    by_key = await store.usage_summary(org.id, group_by="key")
    expected = [(None, None, 1), (key.id, key.prefix, 2)]
    assert [(r["key_id"], r["key_prefix"], r["num_requests"]) for r in by_key] == expected
    window = await store.usage_summary(org.id, start=day2, end=day2 + 1, group_by="model")
    assert [(r["model"], r["cost_usd"]) for r in window] == [("a", 2.0), ("b", 4.0)]
    with pytest.raises(ValueError, match="group_by"):
        await store.usage_summary(org.id, group_by="colour")


async def test_month_spend_counts_only_the_calendar_month_of_now(store: Store, make_record) -> None:
    org = await store.create_org("acme", "plus")
    feb = dt.datetime(2026, 2, 28, 23, 59, tzinfo=dt.UTC).timestamp()
    mar = dt.datetime(2026, 3, 1, 0, 1, tzinfo=dt.UTC).timestamp()
    await store.record_request(make_record(org.id, created_at=feb, cost_usd=1.5))
    await store.record_request(make_record(org.id, created_at=mar, cost_usd=0.25))
    await store.record_request(make_record(org.id, created_at=mar + 60, cost_usd=0.25))

    assert await store.month_spend_usd(org.id, now=feb) == pytest.approx(1.5)
    assert await store.month_spend_usd(org.id, now=mar + 3600) == pytest.approx(0.5)
    assert await store.month_spend_usd(org.id, now=mar + 40 * 86400) == 0.0
