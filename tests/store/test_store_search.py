"""Searching conversations (store/search.py over the FTS5 indexes of schema 13): what is found and
in which order, never another organisation's or a deleted conversation, the index kept by every
write path (checked against the tables after each), query text taken literally, the snippet."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from store.conversations import new_message_id
from store.search import SNIPPET_CHARS, snippet
from store.store import Store
from store.types import Message, NotFound
from tests.store.schema_helpers import drop_created_index, drop_search_index, drop_shares


def assert_index_matches_tables(db_path: Path) -> None:
    """FTS5's integrity check against the external content (rank 1): raises if any write path
    left the index out of step with `messages` or `conversations`."""
    with sqlite3.connect(db_path) as conn:
        for table in ("message_search", "title_search"):
            conn.execute(f"INSERT INTO {table} ({table}, rank) VALUES ('integrity-check', 1)")


async def found(store: Store, org_id: str, text: str, **paging) -> list[tuple[str, str | None]]:
    hits, _more = await store.search_conversations(org_id, text, **paging)
    return [(h.conversation.id, h.message_id) for h in hits]


def turn(*texts: str) -> tuple[Message, ...]:
    """Messages alternating user, assistant."""
    now = time.time()
    return tuple(Message(new_message_id(), ("user", "assistant")[i % 2], t, now) for i, t in enumerate(texts))


async def test_titles_and_messages_are_found_newest_first_with_the_latest_matching_message(
    store: Store, db_path: Path, make_record
) -> None:
    org = await store.create_org("acme", "plus")
    by_title = await store.create_conversation(org.id, title="Lighthouse keeping")
    by_text = await store.create_conversation(org.id, messages=turn("Who keeps a LIGHTHOUSE?", "A keeper."))
    await store.create_conversation(org.id, messages=turn("Nothing to see", "here"))
    await store.record_request(
        make_record(org.id, conversation_id=by_text.id, new_messages=(("user", "and the lighthouse lamp?"),))
    )
    latest = (await store.get_conversation(org.id, by_text.id)).messages[-1]

    hits, has_more = await store.search_conversations(org.id, "lighthouse")
    assert [(h.conversation.id, h.message_id) for h in hits] == [(by_text.id, latest.id), (by_title.id, None)]
    assert not has_more
    assert hits[0].snippet == "and the lighthouse lamp?" and hits[1].snippet is None
    assert hits[1].conversation == await store.get_conversation(org.id, by_title.id, with_messages=False)
    assert await found(store, org.id, "keep") == [(by_text.id, by_text.messages[1].id), (by_title.id, None)]
    assert await found(store, org.id, "lighthouse keeper") == []  # the text as one piece, not its words
    assert_index_matches_tables(db_path)


async def test_another_organisations_and_deleted_conversations_are_never_found(store: Store, db_path: Path) -> None:
    alice = await store.create_org("alice", "plus")
    mallory = await store.create_org("mallory", "plus")
    kept = await store.create_conversation(alice.id, title="secret plans", messages=turn("the secret plans", "ok"))
    gone = await store.create_conversation(alice.id, title="secret too", messages=turn("more secret plans", "ok"))
    assert await store.delete_conversation(alice.id, gone.id)

    assert await found(store, mallory.id, "secret") == []
    assert await found(store, mallory.id, "se") == []  # the short (title) search too
    assert [cid for cid, _ in await found(store, alice.id, "secret")] == [kept.id]
    assert [cid for cid, _ in await found(store, alice.id, "se")] == [kept.id]
    with pytest.raises(NotFound):  # alice's id is no cursor for mallory
        await store.search_conversations(mallory.id, "secret", after=kept.id)

    retention = {"plus": 1}
    assert await store.purge_deleted(retention, now=time.time() + 2 * 86400) == 1
    assert [cid for cid, _ in await found(store, alice.id, "secret")] == [kept.id]
    assert_index_matches_tables(db_path)


async def test_truncated_messages_are_not_found_and_the_turns_after_them_are(
    store: Store, db_path: Path, make_record
) -> None:
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id, title="t", messages=turn("keep this question", "an old answer"))
    assert await store.truncate_conversation(org.id, conv.id, 1)
    assert await found(store, org.id, "old answer") == []
    await store.record_request(make_record(org.id, conversation_id=conv.id, assistant_content="a regenerated answer"))
    assert [cid for cid, _ in await found(store, org.id, "regenerated")] == [conv.id]
    assert [cid for cid, _ in await found(store, org.id, "keep this")] == [conv.id]
    assert_index_matches_tables(db_path)


async def test_a_renamed_conversation_is_found_by_its_new_title_only(store: Store, db_path: Path) -> None:
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id, title="Old name")
    await store.rename_conversation(org.id, conv.id, "Fresh title")
    await store.update_conversation(org.id, conv.id, title=None, metadata={"k": "v"}, set_metadata=True)
    assert await found(store, org.id, "old name") == []
    assert await found(store, org.id, "fresh") == [(conv.id, None)]
    assert_index_matches_tables(db_path)


async def test_a_branch_is_found_and_a_discarded_pending_conversation_is_not(store: Store, db_path: Path) -> None:
    org = await store.create_org("acme", "plus")
    source = await store.create_conversation(org.id, messages=turn("branching question", "branching answer"))
    branch = await store.branch_conversation(org.id, source.id, 1)
    pending = await store.create_conversation(org.id, title="branching pending", pending=True)
    assert await store.discard_pending_conversation(org.id, pending.id)

    hits = await found(store, org.id, "branching")
    assert {cid for cid, _ in hits} == {source.id, branch.id}
    assert dict(hits)[source.id] == source.messages[1].id  # its answer, the latest holding the text
    assert await found(store, org.id, "branching answer") == [(source.id, source.messages[1].id)]
    assert_index_matches_tables(db_path)


@pytest.mark.parametrize(
    "text",
    [
        '"',
        '"unbalanced',
        'say "hi"',
        "a:b",
        "content: x",
        "NEAR(alpha beta)",
        "alpha AND beta",
        "alpha OR",
        "NOT alpha",
        "pre*",
        "*",
        "^start",
        "(((",
        "{content}: x",
        "'; DROP TABLE messages; --",
        "100%",
        "a_b",
        "\\",
    ],
)
async def test_query_syntax_is_searched_for_as_literal_text(store: Store, text: str) -> None:
    org = await store.create_org("acme", "plus")
    holder = await store.create_conversation(org.id, messages=turn(f"before {text} after", "ok"))
    await store.create_conversation(org.id, title="alpha beta start content", messages=turn("alpha beta pre x", "ok"))
    assert [cid for cid, _ in await found(store, org.id, text)] == [holder.id]
    assert [cid for cid, _ in await found(store, org.id, f"e {text} a")] == [holder.id]


async def test_short_text_matches_titles_only_and_like_wildcards_are_literal(store: Store) -> None:
    org = await store.create_org("acme", "plus")
    pct = await store.create_conversation(org.id, title="Up 5% today", messages=turn("ab", "ab"))
    plain = await store.create_conversation(org.id, title="Abacus")
    assert await found(store, org.id, "ab") == [(plain.id, None)]  # not the messages' "ab"
    assert await found(store, org.id, "%") == [(pct.id, None)]
    assert await found(store, org.id, "_") == []
    assert await found(store, org.id, "東京") == []
    tokyo = await store.create_conversation(org.id, title="東京の旅", messages=turn("東京タワーに行きました", "ok"))
    assert await found(store, org.id, "東京") == [(tokyo.id, None)]
    assert await found(store, org.id, "タワー") == [(tokyo.id, tokyo.messages[0].id)]


async def test_pages_of_hits_cover_every_hit_once_in_list_order(store: Store) -> None:
    org = await store.create_org("acme", "plus")
    hits = [await store.create_conversation(org.id, messages=turn(f"needle {i}", "ok")) for i in range(7)]
    await store.create_conversation(org.id, messages=turn("hay", "ok"))
    seen: list[str] = []
    after = None
    while True:
        page, has_more = await store.search_conversations(org.id, "needle", limit=3, after=after)
        seen += [h.conversation.id for h in page]
        if not has_more:
            break
        after = page[-1].conversation.id
    listed, _ = await store.list_conversations(org.id, limit=100)
    assert seen == [c.id for c in listed if c.id in {h.id for h in hits}]
    assert len(seen) == 7


def test_a_snippet_is_bounded_plain_text_around_the_match() -> None:
    content = "word " * 200 + "The Needle\n\n  in   the haystack " + "more " * 200
    cut = snippet(content, "needle")
    assert "Needle in the haystack" in cut  # whitespace collapsed, case as written
    assert cut.startswith("\u2026word ") and cut.endswith(" more\u2026")  # whole words between ellipses
    assert len(cut) <= SNIPPET_CHARS + 2
    assert snippet("short text with needle", "NEEDLE") == "short text with needle"
    assert snippet("x" * 500, "not there") == "x" * SNIPPET_CHARS + "\u2026"  # no match found: the start
    long_match = "a" * 300
    assert snippet("b " + long_match, long_match).startswith("\u2026" + "a" * 10)  # the match's start is shown


async def test_a_database_from_schema_12_gets_its_conversations_indexed(
    db_path: Path, store_config, make_record
) -> None:
    store = await Store.open(db_path, store_config)
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id, title="Before search", messages=turn("an old question", "answer"))
    gone = await store.create_conversation(org.id, title="old and deleted", messages=turn("old words", "x"))
    await store.delete_conversation(org.id, gone.id)
    await store.close()
    with sqlite3.connect(db_path) as conn:  # the file as schema 12 left it
        drop_shares(conn)
        drop_created_index(conn)
        drop_search_index(conn)
        conn.execute("PRAGMA user_version = 12")

    store = await Store.open(db_path, store_config)
    try:
        assert await found(store, org.id, "old question") == [(conv.id, conv.messages[0].id)]
        assert await found(store, org.id, "before search") == [(conv.id, None)]
        assert await found(store, org.id, "old") == [(conv.id, conv.messages[0].id)]
        await store.record_request(make_record(org.id, conversation_id=conv.id, new_messages=(("user", "new one"),)))
        assert [cid for cid, _ in await found(store, org.id, "new one")] == [conv.id]
    finally:
        await store.close()
    assert_index_matches_tables(db_path)
