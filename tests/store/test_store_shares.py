"""Share links in the store: tokens from `secrets`, reads scoped to the organisation, the public read
only while the conversation lives, revocation and deletion removing the snapshot, and snapshots
counted in the organisation's conversation storage."""

from __future__ import annotations

import time

import pytest

from store import shares
from store.conversations import new_message_id
from store.store import Store
from store.types import Message, NotFound, ShareSnapshot

pytestmark = pytest.mark.asyncio


def _snapshot(text: str, last_message_id: str = "msg_x") -> ShareSnapshot:
    return ShareSnapshot("A title", 1, last_message_id, f'{{"messages": ["{text}"]}}', time.time())


async def _conversation(store: Store, org_id: str, text: str = "hello there"):
    return await store.create_conversation(org_id, messages=(Message(new_message_id(), "user", text, time.time()),))


async def test_a_share_is_found_by_its_token_only_while_its_conversation_lives(store: Store) -> None:
    org = await store.create_org("acme", "plus")
    conv = await _conversation(store, org.id)
    share = await store.create_share(org.id, conv.id, _snapshot("one"))
    assert share is not None and share.conversation_id == conv.id
    assert share.id.startswith("share_") and share.id[6:] not in share.token and conv.id[5:] not in share.token
    assert len(share.token) == 32 and await store.shared_snapshot(share.token) == '{"messages": ["one"]}'
    assert await store.shared_snapshot(share.token[:-1] + ("A" if share.token[-1] != "A" else "B")) is None

    assert await store.delete_conversation(org.id, conv.id)
    assert await store.shared_snapshot(share.token) is None
    assert await store.list_shares(org.id) == ([], False), "deleting the conversation deleted its links"
    assert await store.create_share(org.id, conv.id, _snapshot("two")) is None, "a deleted conversation"


async def test_another_organisation_cannot_see_update_revoke_or_share_into_a_conversation(store: Store) -> None:
    alice = await store.create_org("alice", "plus")
    mallory = await store.create_org("mallory", "plus")
    conv = await _conversation(store, alice.id)
    share = await store.create_share(alice.id, conv.id, _snapshot("alice's"))
    assert share is not None

    assert await store.get_share(mallory.id, share.id) is None
    assert await store.list_shares(mallory.id) == ([], False)
    with pytest.raises(NotFound):
        await store.list_shares(mallory.id, after=share.id)
    assert await store.replace_share_snapshot(mallory.id, share.id, _snapshot("mallory's")) is None
    assert await store.delete_share(mallory.id, share.id) is False
    assert await store.create_share(mallory.id, conv.id, _snapshot("mallory's")) is None
    assert await store.shared_snapshot(share.token) == '{"messages": ["alice\'s"]}'


async def test_an_update_keeps_the_token_and_a_revoke_deletes_the_snapshot(store: Store) -> None:
    org = await store.create_org("acme", "plus")
    conv = await _conversation(store, org.id)
    share = await store.create_share(org.id, conv.id, _snapshot("first"))
    assert share is not None
    updated = await store.replace_share_snapshot(org.id, share.id, _snapshot("second", "msg_b"))
    assert updated is not None and (updated.token, updated.last_message_id) == (share.token, "msg_b")
    assert await store.shared_snapshot(share.token) == '{"messages": ["second"]}'

    assert await store.delete_share(org.id, share.id)
    assert await store.shared_snapshot(share.token) is None
    assert await store.get_share(org.id, share.id) is None
    assert await store.delete_share(org.id, share.id) is False


async def test_snapshots_count_in_the_conversation_storage_until_revoked(store: Store) -> None:
    org = await store.create_org("acme", "plus")
    conv = await _conversation(store, org.id, "x" * 100)
    assert await store.conversation_bytes(org.id) == 100
    snapshot = _snapshot("y" * 50)
    share = await store.create_share(org.id, conv.id, snapshot)
    assert share is not None and share.num_chars == len(snapshot.snapshot_json)
    assert await store.conversation_bytes(org.id) == 100 + len(snapshot.snapshot_json)
    await store.delete_share(org.id, share.id)
    assert await store.conversation_bytes(org.id) == 100


async def test_list_pages_newest_first_and_narrows_to_one_conversation(store: Store) -> None:
    org = await store.create_org("acme", "plus")
    first, second = await _conversation(store, org.id), await _conversation(store, org.id)
    made = [await store.create_share(org.id, c.id, _snapshot(str(i))) for i, c in enumerate([first, second, first])]
    ids = [s.id for s in made if s is not None]
    page, has_more = await store.list_shares(org.id, limit=2)
    assert [s.id for s in page] == ids[::-1][:2] and has_more
    rest, has_more = await store.list_shares(org.id, limit=2, after=page[-1].id)
    assert [s.id for s in rest] == [ids[0]] and not has_more
    narrowed, _ = await store.list_shares(org.id, conversation_id=first.id)
    assert [s.id for s in narrowed] == [ids[2], ids[0]]


async def test_a_conversation_deleted_outright_takes_its_shares_with_it(store: Store) -> None:
    """The table's cascade, for deletes that bypass soft_delete (a pending conversation at start, a purge)."""
    org = await store.create_org("acme", "plus")
    conv = await store.create_conversation(org.id, pending=True)
    share = await store.create_share(org.id, conv.id, _snapshot("cut by a crash"))
    assert share is not None
    assert await store.delete_pending_conversations() == 1
    assert await store.get_share(org.id, share.id) is None
    assert await store.conversation_bytes(org.id) == 0


async def test_tokens_are_32_url_safe_characters_from_secrets_and_never_repeat() -> None:
    tokens = {shares.new_token() for _ in range(1000)}
    assert len(tokens) == 1000
    assert all(len(t) == 32 and t.replace("-", "").replace("_", "").isalnum() for t in tokens)
