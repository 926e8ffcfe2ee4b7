"""Aging that survives a refusal: since when each API key has been refused a place for load.

A request refused for load (queue full, wait too long, displaced) starts its key's record; a
retry from that key enters the line with the arrival the record holds, so it ranks as if it
had waited since then (one priority level per `aging_s`). Without it a refused request never
ages, and a lower tier starves whenever a higher one alone exceeds capacity. Pure state on an
injected clock: callers decide what counts as a refusal and an admission.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from gateway.errors import MAX_RETRY_AFTER_S

MAX_KEYS = 4096  # keys remembered at once; the least recently refused is forgotten first


def expire_s(aging_s: float) -> float:
    """How long a key may go unrefused and keep its record: longer than any Retry-After the
    server sends (a client that obeys one comes back with its age), plus one aging step."""
    return MAX_RETRY_AFTER_S + aging_s


class RetryAges:
    """Per key: (first refusal, last refusal) of its still-unserved asking, bounded and expiring.

    A key's record ends when it gets a reservation (`admitted`), when the key has not been
    refused for `expire_s(aging_s)` (the client gave up: it went quiet longer than any
    Retry-After it was sent), or when `max_keys` newer keys push it out. aging_s <= 0 (no
    aging) keeps nothing. Keys are the limiter's: an API key id, or one "org:<id>" for every
    keyless request of an organisation (keyless local use is one identity).
    """

    def __init__(self, aging_s: float, clock: Callable[[], float], *, max_keys: int = MAX_KEYS):
        self.aging_s = aging_s
        self.expire_s = expire_s(aging_s)
        self.max_keys = max_keys
        self._clock = clock
        self._records: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (first_s, last_s)

    def __len__(self) -> int:
        return len(self._records)

    def waiting_since(self, key: str) -> float | None:
        """The arrival a new request of `key` carries into the line; None: it arrives now."""
        record = self._records.get(key)
        if record is None:
            return None
        if self._clock() - record[1] > self.expire_s:
            del self._records[key]
            return None
        return record[0]

    def refused(self, key: str, since_s: float | None = None) -> None:
        """`key`'s request was refused for load; `since_s`: it had been waiting since then
        (a displaced request). The earliest start of a live record is kept."""
        if self.aging_s <= 0:
            return
        now = self._clock()
        first_s = now if since_s is None else min(since_s, now)
        live = self.waiting_since(key)
        if live is not None:
            first_s = min(first_s, live)
        self._records[key] = (first_s, now)
        self._records.move_to_end(key)
        while len(self._records) > self.max_keys:
            self._records.popitem(last=False)

    def admitted(self, key: str) -> None:
        """`key` got a reservation: its next request arrives fresh."""
        self._records.pop(key, None)
