"""The key cache as pure state on a fake clock: age, the key's own expiry, invalidation
racing a lookup, the size bound and which entries a refresh re-reads."""

from __future__ import annotations

from store.keycache import MISS, KeyCache, LiveKey
from store.types import Org, Principal


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _live(key_id: str = "key_1", expires_at: float | None = None) -> LiveKey:
    return LiveKey(Principal(key_id, Org("org_1", "acme", "plus", None)), expires_at)


def _cache(max_age_s: float = 5.0, max_entries: int = 100) -> tuple[KeyCache, FakeClock, FakeClock]:
    mono, wall = FakeClock(), FakeClock(2_000_000_000.0)
    return KeyCache(max_age_s, max_entries, clock=mono, wall_clock=wall), mono, wall


def test_a_cached_key_is_answered_until_its_lookup_is_older_than_max_age() -> None:
    cache, mono, _wall = _cache(max_age_s=5.0)
    assert cache.get("h") is MISS
    cache.put("h", _live(), cache.generation, checked_s=mono())
    mono.now += 5.0
    assert cache.get("h").key_id == "key_1"
    mono.now += 0.01
    assert cache.get("h") is MISS  # too old: read the database again


def test_a_cached_key_that_expires_is_refused_at_once_and_an_unknown_key_stays_refused() -> None:
    cache, mono, wall = _cache()
    cache.put("h", _live(expires_at=wall.now + 1.0), cache.generation, checked_s=mono())
    cache.put("unknown", None, cache.generation, checked_s=mono())
    assert cache.get("h") is not None
    wall.now += 1.0
    assert cache.get("h") is None
    assert cache.get("unknown") is None


def test_a_lookup_that_began_before_an_invalidation_is_not_stored() -> None:
    cache, mono, _wall = _cache()
    cache.put("h", _live(), cache.generation, checked_s=mono())
    generation = cache.generation  # a lookup begins, reading the key as live
    cache.invalidate()  # meanwhile the key is revoked through this process
    cache.put("h", _live(), generation, checked_s=mono())
    assert cache.get("h") is MISS and len(cache) == 0


def test_the_least_recently_used_entries_go_past_the_size_bound() -> None:
    cache, mono, _wall = _cache(max_entries=2)
    for key_hash in ("a", "b"):
        cache.put(key_hash, _live(key_hash), cache.generation, checked_s=mono())
    assert cache.get("a") is not None  # b is now the least recently used
    cache.put("c", _live("c"), cache.generation, checked_s=mono())
    assert cache.get("b") is MISS and cache.get("a") is not None and cache.get("c") is not None


def test_a_refresh_rereads_only_entries_used_since_the_last_one() -> None:
    cache, mono, _wall = _cache()
    for key_hash in ("idle", "hit", "looked_up"):
        cache.put(key_hash, _live(), cache.generation, checked_s=mono())  # a lookup is a use
    assert sorted(cache.in_use()) == ["hit", "idle", "looked_up"]
    for key_hash in ("idle", "hit", "looked_up"):  # the refresh's answers
        cache.put(key_hash, _live(), cache.generation, checked_s=mono(), is_refresh=True)
    assert cache.get("hit") is not None
    cache.put("looked_up", _live(), cache.generation, checked_s=mono())
    assert sorted(cache.in_use()) == ["hit", "looked_up"]
    assert cache.get("idle") is MISS  # unused for a whole interval: dropped, not re-read
    assert cache.in_use() == []


def test_max_age_zero_caches_nothing() -> None:
    cache, mono, _wall = _cache(max_age_s=0.0)
    cache.put("h", _live(), cache.generation, checked_s=mono())
    assert not cache.is_enabled and cache.get("h") is MISS
