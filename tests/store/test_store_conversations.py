"""Conversations: isolation between organisations, pagination, turns, soft delete and purge."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from store.conversations import created_page_query
from store.store import Store
from store.types import ImportedConversation, Message, NotFound

pytestmark = pytest.mark.asyncio


async def test_another_orgs_conversation_behaves_as_not_found(store: Store, make_record) -> None:
    alice = await store.create_org("alice", "plus")
    mallory = await store.create_org("mallory", "plus")
    conv = await store.create_conversation(alice.id, title="secret plans")

    assert await store.get_conversation(mallory.id, conv.id) is None
    assert await store.rename_conversation(mallory.id, conv.id, "mine now") is None
    assert await store.truncate_conversation(mallory.id, conv.id, 0) is False
    assert await store.delete_conversation(mallory.id, conv.id) is False
    assert await store.list_conversations(mallory.id) == ([], False)
    with pytest.raises(NotFound):
        await store.list_conversations(mallory.id, after=conv.id)
    # A request billed to mallory naming alice's conversation does not write into it.
    await store.record_request(make_record(mallory.id, conversation_id=conv.id, new_messages=(("user", "hi"),)))

    kept = await store.get_conversation(alice.id, conv.id)
    assert kept is not None and kept.title == "secret plans" and kept.messages == ()


async def test_list_is_newest_first_and_pages_cover_everything_once(store: Store) -> None:
    org = await store.create_org("acme", "plus")
    created = [await store.create_conversation(org.id, title=f"c{i}") for i in range(7)]

    seen: list[str] = []
    after = None
    while True:
        page, has_more = await store.list_conversations(org.id, limit=3, after=after)
        seen += [c.id for c in page]
        if not has_more:
            break
        after = page[-1].id
    assert sorted(seen) == sorted(c.id for c in created) and len(seen) == 7

    full, has_more = await store.list_conversations(org.id, limit=100)
    assert not has_more
    keys = [(c.updated_at, c.id) for c in full]
    assert keys == sorted(keys, reverse=True)


async def test_pages_by_creation_miss_no_conversation_that_changes_while_they_are_read(store: Store) -> None:
    org = await store.create_org("acme", "plus")
    created = [await store.create_conversation(org.id, title=f"c{i}") for i in range(5)]
    other = await store.create_org("other", "plus")
    await store.create_conversation(other.id, title="theirs")

    first = await store.list_conversations_created(org.id, limit=2)
    # Meanwhile the oldest gets a new title (a new updated_at) and one not yet read is deleted.
    await store.rename_conversation(org.id, created[0].id, "renamed")
    assert await store.delete_conversation(org.id, created[1].id)
    rest: list = []
    before = (first[-1].created_at, first[-1].id)
    while page := await store.list_conversations_created(org.id, limit=2, before=before):
        rest += page
        before = (page[-1].created_at, page[-1].id)

    assert [c.id for c in first + rest] == [c.id for c in created[::-1] if c is not created[1]]
    assert rest[-1].title == "renamed"


@pytest.mark.parametrize("before", [None, (1.0, "conv_x")])
async def test_a_page_by_creation_is_read_in_order_from_an_index_not_sorted(store: Store, before) -> None:
    # Without an index in (org, created_at, id) order every page of an export sorted all the
    # organisation's conversations again: thousands of them made the export quadratic.
    sql, params = created_page_query("org_x", 50, before)
    plan = " | ".join(r[3] for r in await store._write_conn.execute_fetchall(f"EXPLAIN QUERY PLAN {sql}", params))
    assert "conversations_created" in plan and "TEMP B-TREE" not in plan, plan


async def test_a_new_turn_moves_the_conversation_to_the_top_and_titles_it(store: Store, make_record) -> None:
    org = await store.create_org("acme", "plus")
    old = await store.create_conversation(org.id)
    await store.create_conversation(org.id, title="newer")
    rec = make_record(
        org.id,
        conversation_id=old.id,
        new_messages=(("user", "  How do   tides\nwork? " + "x" * 200),),
        assistant_content="The moon.",
        finished_at=time.time() + 10,
    )
    assert await store.record_request(rec)

    page, _ = await store.list_conversations(org.id)
    assert page[0].id == old.id
    conv = await store.get_conversation(org.id, old.id)
    assert conv is not None
    assert conv.title is not None and conv.title.startswith("How do tides work? xxx") and len(conv.title) <= 80
    expected = [("user", rec.new_messages[0][1]), ("assistant", "The moon.")]
    assert [(m.role, m.content) for m in conv.messages] == expected
    assistant = conv.messages[1]
    assert (assistant.tokens, assistant.model) == (rec.completion_tokens, rec.model)
    assert conv.messages[0].tokens is None


async def test_rename_keeps_messages_and_a_given_title_is_not_overwritten(store: Store, make_record) -> None:
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id)
    await store.record_request(make_record(org.id, conversation_id=conv.id, new_messages=(("user", "first"),)))
    renamed = await store.rename_conversation(org.id, conv.id, "Chosen")
    assert renamed is not None and renamed.title == "Chosen"
    await store.record_request(make_record(org.id, conversation_id=conv.id, new_messages=(("user", "second"),)))
    conv = await store.get_conversation(org.id, conv.id)
    assert conv is not None and conv.title == "Chosen"
    assert [m.content for m in conv.messages] == ["first", "second"]


async def test_truncate_drops_the_tail_and_later_turns_append_after_it(store: Store, make_record) -> None:
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id)
    for i in range(3):
        rec = make_record(org.id, conversation_id=conv.id, new_messages=(("user", f"q{i}"),), assistant_content=f"a{i}")
        await store.record_request(rec)

    assert await store.truncate_conversation(org.id, conv.id, 3) is True  # keep q0 a0 q1
    rec = make_record(org.id, conversation_id=conv.id, assistant_content="a1-regenerated")
    await store.record_request(rec)

    conv = await store.get_conversation(org.id, conv.id)
    assert conv is not None
    assert [m.content for m in conv.messages] == ["q0", "a0", "q1", "a1-regenerated"]


async def test_deleted_conversation_is_gone_at_once_and_purged_after_retention(
    store: Store, db_path: Path, make_record
) -> None:
    free = await store.create_org("f", "free")
    ent = await store.create_org("e", "enterprise")
    free_conv = await store.create_conversation(free.id)
    ent_conv = await store.create_conversation(ent.id)
    await store.record_request(make_record(free.id, conversation_id=free_conv.id, new_messages=(("user", "hi"),)))
    assert await store.delete_conversation(free.id, free_conv.id) is True
    assert await store.delete_conversation(ent.id, ent_conv.id) is True

    assert await store.get_conversation(free.id, free_conv.id) is None
    assert await store.list_conversations(free.id) == ([], False)
    assert await store.delete_conversation(free.id, free_conv.id) is False
    assert await store.rename_conversation(free.id, free_conv.id, "back?") is None

    retention = {"free": 7, "enterprise": 90}
    assert await store.purge_deleted(retention) == 0  # deleted just now
    assert await store.purge_deleted(retention, now=time.time() + 8 * 86400) == 1  # free only
    assert await store.purge_deleted(retention, now=time.time() + 91 * 86400) == 1  # then enterprise
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT count(*) FROM conversations").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM messages").fetchone()[0] == 0  # cascaded
        assert conn.execute("SELECT count(*) FROM usage").fetchone()[0] == 1  # the ledger stays


async def test_a_turn_for_a_deleted_conversation_is_still_billed(store: Store, make_record) -> None:
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id)
    await store.delete_conversation(org.id, conv.id)
    rec = make_record(org.id, conversation_id=conv.id, new_messages=(("user", "hi"),), assistant_content="hello")
    assert await store.record_request(rec) is True
    assert await store.month_spend_usd(org.id) == pytest.approx(rec.cost_usd)


async def test_a_billed_read_gives_each_answer_its_ledger_row_and_nothing_else(
    store: Store, db_path: Path, make_record
) -> None:
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id)
    first = make_record(org.id, conversation_id=conv.id, new_messages=(("user", "q0"),), assistant_content="a0")
    second = make_record(
        org.id,
        conversation_id=conv.id,
        new_messages=(("user", "q1"),),
        assistant_content="a1",
        prompt_tokens=240,
        cached_tokens=192,
        completion_tokens=7,
        cost_usd=0.000123,
        fallback_from="demo-large",
    )
    for rec in (first, second):
        await store.record_request(rec)
    with sqlite3.connect(db_path) as conn:  # an answer whose request left no ledger row
        conn.execute("UPDATE messages SET request_id = 'req-unbilled' WHERE content = 'a0'")

    found = await store.get_billed_conversation(org.id, conv.id)
    assert found is not None
    billed_conv, billed = found
    assert billed_conv == await store.get_conversation(org.id, conv.id)
    answer = billed_conv.messages[3]
    assert list(billed) == [answer.id]  # not the user messages, not the unbilled answer
    usage = billed[answer.id]
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (240, 192, 7)
    assert (usage.cost_usd, usage.fallback_from) == (pytest.approx(0.000123), "demo-large")
    other = await store.create_org("other", "plus")
    assert await store.get_billed_conversation(other.id, conv.id) is None


async def test_imported_conversations_keep_their_times_and_messages_under_new_ids(store: Store) -> None:
    org = await store.create_org("acme", "plus")
    answer = Message("msg_a", "assistant", "the answer", 1_600_000_010.0, tokens=3, model="m", finish_reason="stop")
    imported = [
        ImportedConversation(
            "Old",
            1_600_000_000.0,
            1_600_000_020.0,
            {"k": "v"},
            (Message("msg_q", "user", "q", 1_600_000_005.0), answer),
        ),
        ImportedConversation(None, 1_600_000_001.0, 1_600_000_001.0, {}, ()),
    ]
    old, empty = await store.import_conversations(org.id, imported)

    stored = await store.get_conversation(org.id, old.id)
    assert stored is not None and (stored.title, stored.created_at, stored.updated_at) == (
        "Old",
        1_600_000_000.0,
        1_600_000_020.0,
    )
    assert stored.metadata == {"k": "v"} and stored.messages[1] == answer  # in order, as given
    assert [m.content for m in stored.messages] == ["q", "the answer"]
    assert (await store.get_conversation(org.id, empty.id)) == empty
    assert await store.get_billed_conversation(org.id, old.id) == (stored, {})  # no ledger row: never billed
    hits, _ = await store.search_conversations(org.id, "answer")
    assert [h.conversation.id for h in hits] == [old.id]
