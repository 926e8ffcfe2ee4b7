"""Organisations and API keys: hashed storage, authentication, revocation, the CLI."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sqlite3
import time
from pathlib import Path

import pytest

from settings import Settings, StoreConfig, TierConfig
from store.cli import add_cli, run_cli
from store.store import UNSET, Store
from store.types import Conflict, NotFound

pytestmark = pytest.mark.asyncio


def _raw_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


async def test_key_is_stored_only_as_hash_prefix_and_last4(store: Store, db_path: Path) -> None:
    await store.create_org("acme", "plus")
    key, secret = await store.create_key("acme", name="ci")

    assert secret.startswith("sk-") and len(secret) > 40
    assert secret.startswith(key.prefix) and secret.endswith(key.last4)
    with sqlite3.connect(db_path) as conn:
        row = conn.execute("SELECT * FROM api_keys WHERE id = ?", (key.id,)).fetchone()
    assert hashlib.sha256(secret.encode()).hexdigest() in row
    assert secret not in row
    # Nowhere in the file or its WAL: not in another column, not in a log table.
    assert secret.encode() not in _raw_bytes(db_path)
    listed = await store.list_keys("acme")
    assert [k.display for k in listed] == [f"{key.prefix}...{key.last4}"]
    assert secret not in repr(listed)


async def test_authenticate_finds_the_org_and_a_revoked_key_fails(store: Store) -> None:
    org = await store.create_org("acme", "plus", budget_usd=25.0, limits={"requests_per_minute": 7})
    key, secret = await store.create_key("acme")

    principal = await store.authenticate(secret)
    assert principal is not None
    assert principal.key_id == key.id and principal.org == org
    assert principal.org.limits == {"requests_per_minute": 7}

    assert await store.revoke_key(key.prefix) is True
    assert await store.authenticate(secret) is None
    assert await store.revoke_key(key.prefix) is False  # already revoked
    assert (await store.list_keys())[0].revoked_at is not None


async def test_an_expired_key_fails_and_the_cli_sets_and_lists_expiry(
    store: Store, db_path: Path, capsys: pytest.CaptureFixture
) -> None:
    await store.create_org("acme", "plus")
    _key, lasting = await store.create_key("acme", expires_at=time.time() + 3600)
    _key, expired = await store.create_key("acme", expires_at=time.time() - 1)
    assert await store.authenticate(lasting) is not None
    assert await store.authenticate(expired) is None
    settings = Settings(tiers={"plus": TierConfig()})
    args = _cli("keys", "create", "--org", "acme", "--expires-in-days", "0.5", "--db", str(db_path))
    assert await run_cli(args, settings) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    assert await store.authenticate(secret) is not None
    assert await run_cli(_cli("keys", "list", "--db", str(db_path)), settings) == 0
    listing = capsys.readouterr().out
    assert "expired" in listing and listing.count("expires ") == 2


async def test_unknown_altered_or_oversized_secrets_are_rejected(store: Store) -> None:
    await store.create_org("acme", "plus")
    _, secret = await store.create_key("acme")
    assert await store.authenticate(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert await store.authenticate(secret.upper()) is None
    assert await store.authenticate("") is None
    assert await store.authenticate("sk-" + "x" * 10_000) is None
    assert await store.authenticate(secret) is not None


async def test_duplicate_org_name_is_a_conflict_and_other_writes_in_the_batch_land(store: Store) -> None:
    results = await asyncio.gather(
        store.create_org("a", "free"),
        store.create_org("a", "plus"),
        store.create_org("b", "free"),
        return_exceptions=True,
    )
    assert sum(isinstance(r, Conflict) for r in results) == 1
    assert sorted(o.name for o in await store.list_orgs()) == ["a", "b"]


async def test_update_org_changes_only_the_given_fields(store: Store) -> None:
    await store.create_org("acme", "free", budget_usd=10.0, limits={"max_tokens": 64})
    org = await store.update_org("acme", tier="plus")
    assert (org.tier, org.budget_usd, org.limits) == ("plus", 10.0, {"max_tokens": 64})
    org = await store.update_org("acme", budget_usd=None, limits=UNSET)
    assert (org.tier, org.budget_usd, org.limits) == ("plus", None, {"max_tokens": 64})
    with pytest.raises(NotFound):
        await store.update_org("nobody", tier="plus")


async def test_ensure_org_creates_once_and_follows_the_configured_tier(store: Store) -> None:
    first = await store.ensure_org("local", "enterprise")
    assert await store.ensure_org("local", "enterprise") == first
    changed = await store.ensure_org("local", "plus")
    assert changed.id == first.id and changed.tier == "plus"


async def test_create_key_for_a_missing_org_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        await store.create_key("nobody")
    with pytest.raises(NotFound):
        await store.list_keys("nobody")


async def test_last_used_is_kept_in_memory_and_written_on_close(db_path: Path, store_config: StoreConfig) -> None:
    store = await Store.open(db_path, store_config)
    await store.create_org("acme", "plus")
    key, secret = await store.create_key("acme")
    for _ in range(5):
        await store.authenticate(secret)
    with sqlite3.connect(db_path) as conn:  # not written per request
        assert conn.execute("SELECT last_used_at FROM api_keys").fetchone()[0] is None
    assert (await store.list_keys())[0].last_used_at is not None  # but visible at once
    await store.close()

    with sqlite3.connect(db_path) as conn:
        (last_used_at,) = conn.execute("SELECT last_used_at FROM api_keys").fetchone()
    assert last_used_at is not None and last_used_at >= key.created_at


async def test_last_used_is_flushed_periodically(db_path: Path) -> None:
    store = await Store.open(db_path, StoreConfig(last_used_flush_s=0.05))
    await store.create_org("acme", "plus")
    _, secret = await store.create_key("acme")
    await store.authenticate(secret)
    for _ in range(100):
        await asyncio.sleep(0.05)
        with sqlite3.connect(db_path) as conn:
            if conn.execute("SELECT last_used_at FROM api_keys").fetchone()[0] is not None:
                break
    else:
        pytest.fail("last_used_at was never flushed")
    await store.close()


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


async def test_cli_creates_lists_and_revokes_keys(db_path: Path, capsys: pytest.CaptureFixture) -> None:
    settings = Settings(tiers={"plus": TierConfig(), "free": TierConfig()})
    db = ("--db", str(db_path))
    assert await run_cli(_cli("keys", "create", "--org", "acme", "--tier", "plus", "--budget", "5", *db), settings) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    assert secret.startswith("sk-")

    assert await run_cli(_cli("keys", "list", *db), settings) == 0
    listing = capsys.readouterr().out
    assert secret[:11] in listing and secret[-4:] in listing and secret not in listing

    assert await run_cli(_cli("keys", "create", "--org", "acme", "--tier", "free", *db), settings) == 1
    assert await run_cli(_cli("orgs", "create", "x", "--tier", "gold", *db), settings) == 1  # unknown tier
    capsys.readouterr()
    # Only the per-key rate limits can be overridden; another name is refused, not stored and ignored.
    not_overridable = _cli("orgs", "set", "acme", "--limit", "max_tokens=64", *db)
    assert await run_cli(not_overridable, settings) == 1
    assert "'max_tokens' is not a limit" in capsys.readouterr().err
    assert await run_cli(_cli("orgs", "set", "acme", "--limit", "tokens_per_minute=-5", *db), settings) == 1
    org_set = _cli("orgs", "set", "acme", "--budget", "none", "--limit", "tokens_per_minute=640", *db)
    assert await run_cli(org_set, settings) == 0
    # The limits read back as `--limit` takes them, not as a Python dict.
    assert capsys.readouterr().out.endswith("tier plus, budget none, limits tokens_per_minute=640\n")
    assert await run_cli(_cli("orgs", "list", *db), settings) == 0
    assert capsys.readouterr().out.rstrip().endswith(" limits tokens_per_minute=640")
    admin = _cli("keys", "create", "--org", "acme", "--scope", "admin", "--expires-in-days", "1", *db)
    assert await run_cli(admin, settings) == 0
    admin_secret = capsys.readouterr().out.strip().splitlines()[-1]
    assert await run_cli(_cli("keys", "list", "--org", "acme", *db), settings) == 0
    listed = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("sk-")]
    assert [cols[3] for cols in listed] == ["inference", "admin"]
    with pytest.raises(SystemExit):  # refused while parsing, before anything is opened
        _cli("keys", "create", "--org", "acme", "--expires-in-days", "0", *db)
    assert await run_cli(_cli("keys", "revoke", secret[:11], *db), settings) == 0
    assert await run_cli(_cli("keys", "revoke", secret[:11], *db), settings) == 1

    store = await Store.open(db_path, StoreConfig())
    try:
        assert await store.authenticate(secret) is None
        assert (await store.authenticate(admin_secret)).is_admin
        org = await store.get_org("acme")
        assert org is not None and org.budget_usd is None and org.limits == {"tokens_per_minute": 640}
    finally:
        await store.close()


async def test_a_cached_key_revoked_or_its_org_changed_through_this_store_is_seen_at_once(
    db_path: Path,
) -> None:
    store = await Store.open(db_path, StoreConfig(key_cache_s=3600.0))
    try:
        await store.create_org("acme", "plus")
        key, secret = await store.create_key("acme")
        assert (await store.authenticate(secret)).org.tier == "plus"  # now cached
        await store.update_org("acme", tier="free")
        assert (await store.authenticate(secret)).org.tier == "free"
        assert await store.revoke_key(key.prefix)
        assert await store.authenticate(secret) is None
    finally:
        await store.close()


async def test_a_cached_key_that_expires_is_refused_without_a_lookup(db_path: Path) -> None:
    store = await Store.open(db_path, StoreConfig(key_cache_s=3600.0))
    try:
        await store.create_org("acme", "plus")
        _key, secret = await store.create_key("acme", expires_at=time.time() + 0.3)
        assert await store.authenticate(secret) is not None
        await asyncio.sleep(0.35)
        assert await store.authenticate(secret) is None
    finally:
        await store.close()


async def test_a_key_revoked_by_another_process_is_refused_within_key_cache_s(db_path: Path) -> None:
    """Another process (the `keys revoke` CLI) writes the file; this store sees it by re-reading
    the cached keys in the background, not on the request path."""
    cached = await Store.open(db_path, StoreConfig(key_cache_s=3600.0))
    fresh = await Store.open(db_path, StoreConfig(key_cache_s=0.2))
    try:
        await cached.create_org("acme", "plus")
        key, secret = await cached.create_key("acme")
        assert await cached.authenticate(secret) is not None
        assert await fresh.authenticate(secret) is not None
        with sqlite3.connect(db_path) as conn:
            conn.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (time.time(), key.id))
        assert await cached.authenticate(secret) is not None  # answered from memory: no SQL read
        for _ in range(100):
            if await fresh.authenticate(secret) is None:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the revocation was never seen")
    finally:
        await fresh.close()
        await cached.close()
