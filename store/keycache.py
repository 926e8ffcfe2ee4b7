"""`KeyCache`: what an API key's hash resolved to, kept in memory so authentication reads no SQL.

Pure state with an injected clock; `Store` fills it on a miss, re-reads the keys in use in
the background and clears it on every key or organisation write made through this process.
It must not decide access by itself beyond what the last lookup said: an entry is trusted
for `max_age_s` after that lookup, and a key's own expiry is checked on every hit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from store.types import Principal

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class LiveKey:
    """A key that was neither revoked nor unknown when it was read."""

    principal: Principal
    expires_at: float | None  # unix s; None: never

    def principal_at(self, now: float) -> Principal | None:
        """The principal while the key has not expired at `now` (unix s)."""
        return self.principal if self.expires_at is None or self.expires_at > now else None


@dataclass(frozen=True, slots=True)
class _Entry:
    key: LiveKey | None  # None: no live key has this hash (unknown or revoked)
    checked_s: float  # monotonic time of the lookup this entry came from
    is_used: bool  # hit since the last refresh (the refresh re-reads only entries in use)


class _Miss:
    def __repr__(self) -> str:
        return "MISS"


MISS = _Miss()  # not cached, or cached too long ago: read the database


class KeyCache:
    """key hash -> LiveKey (or None), least recently used dropped past `max_entries`.

    Lookups that started before an `invalidate()` (a `generation` ago) are not stored, so a
    write made here is never undone by a read that raced with it.
    """

    def __init__(
        self, max_age_s: float, max_entries: int = 10_000, clock: Clock = time.monotonic, wall_clock: Clock = time.time
    ):
        self.max_age_s = max_age_s
        self._max_entries = max_entries
        self._clock = clock
        self._wall_clock = wall_clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.generation = 0

    @property
    def is_enabled(self) -> bool:
        return self.max_age_s > 0

    def now(self) -> float:
        return self._clock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key_hash: str) -> Principal | _Miss | None:
        """The principal, None for a key known not to be live (or expired now), or MISS."""
        entry = self._entries.get(key_hash)
        if entry is None or self._clock() - entry.checked_s > self.max_age_s:
            return MISS
        if not entry.is_used:
            self._entries[key_hash] = _Entry(entry.key, entry.checked_s, True)
        self._entries.move_to_end(key_hash)
        return None if entry.key is None else entry.key.principal_at(self._wall_clock())

    def put(
        self, key_hash: str, key: LiveKey | None, generation: int, *, checked_s: float, is_refresh: bool = False
    ) -> None:
        """Store a lookup's answer unless the cache was invalidated since it began.

        `checked_s`: when the lookup began (`now()`). A request's lookup is a use; a background
        refresh keeps the entry's flag (a hit may have come while it read).
        """
        if not self.is_enabled or generation != self.generation:
            return
        old = self._entries.get(key_hash)
        is_used = (old is not None and old.is_used) if is_refresh else True
        self._entries[key_hash] = _Entry(key, checked_s, is_used)
        self._entries.move_to_end(key_hash)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def in_use(self) -> list[str]:
        """Hashes used since the last call, now marked unused; the others are dropped (idle)."""
        used = [h for h, e in self._entries.items() if e.is_used]
        for key_hash in [h for h, e in self._entries.items() if not e.is_used]:
            del self._entries[key_hash]
        for key_hash in used:
            entry = self._entries[key_hash]
            self._entries[key_hash] = _Entry(entry.key, entry.checked_s, False)
        return used

    def invalidate(self) -> None:
        """Forget everything: a key or organisation changed through this process."""
        self._entries.clear()
        self.generation += 1
