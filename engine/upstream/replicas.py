"""The replicas of one upstream model: who is healthy, who has room, who gets the next request.

Least outstanding requests among the replicas that can take one, except that a conversation
goes back to the replica that served its previous turn while that one is healthy and has
room (its prefix cache holds the history). Pure bookkeeping with the clock passed in; the
backend does the HTTP.
"""

from __future__ import annotations

import hashlib
import itertools
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import orjson

from engine.types import GenerationRequest
from engine.upstream.breaker import BreakerState, CircuitBreaker, FailureKind
from engine.upstream.metrics import LatencyHistogram


class Replica:
    """One upstream server: its URL, breaker and live counters."""

    __slots__ = ("index", "base_url", "label", "breaker", "num_in_flight", "num_requests", "num_errors", "ttft")

    def __init__(self, index: int, base_url: str, breaker: CircuitBreaker):
        self.index = index
        self.base_url = base_url.rstrip("/")
        self.label = public_url(self.base_url)  # for logs and /metrics: never credentials
        self.breaker = breaker
        self.num_in_flight = 0
        self.num_requests = 0
        self.num_errors: dict[FailureKind, int] = dict.fromkeys(FailureKind, 0)
        self.ttft = LatencyHistogram()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def can_take(self, max_in_flight: int) -> bool:
        state = self.breaker.state
        if state is BreakerState.CLOSED:
            return self.num_in_flight < max_in_flight
        return state is BreakerState.HALF_OPEN and self.num_in_flight == 0  # one trial at a time


class ReplicaPool:
    def __init__(self, replicas: Sequence[Replica], max_in_flight: int, affinity_entries: int):
        if not replicas:
            raise ValueError("an upstream model needs at least one replica URL")
        self.replicas = tuple(replicas)
        self.max_in_flight = max(1, max_in_flight)
        self._affinity: OrderedDict[bytes, int] = OrderedDict()  # key -> replica index, LRU
        self._max_affinity = max(0, affinity_entries)
        self._turn = itertools.count()  # rotates ties so idle replicas share the first requests

    @property
    def is_available(self) -> bool:
        """False when every replica's breaker is open: the model cannot serve now."""
        return any(r.breaker.state is not BreakerState.OPEN for r in self.replicas)

    def has_room(self) -> bool:
        # When nothing is reachable, admit anyway: the request fails at once with a 503
        # instead of waiting in our queue for a replica that may not come back.
        return not self.is_available or any(r.can_take(self.max_in_flight) for r in self.replicas)

    def pick(self, key: bytes | None, exclude: frozenset[int] = frozenset()) -> Replica | None:
        """The replica for the next attempt, or None when none can take it."""
        ready = [r for r in self.replicas if r.index not in exclude and r.can_take(self.max_in_flight)]
        if not ready:
            return None
        if key is not None and (index := self._affinity.get(key)) is not None:
            sticky = self.replicas[index]
            if sticky in ready:
                self._affinity.move_to_end(key)
                return sticky
        turn = next(self._turn)
        n = len(self.replicas)
        return min(ready, key=lambda r: (r.num_in_flight, (r.index - turn) % n))

    def remember(self, key: bytes | None, replica: Replica) -> None:
        """The conversation's latest turn was served by `replica`."""
        if key is None or self._max_affinity == 0:
            return
        self._affinity[key] = replica.index
        self._affinity.move_to_end(key)
        while len(self._affinity) > self._max_affinity:
            self._affinity.popitem(last=False)


def affinity_key(request: GenerationRequest) -> bytes | None:
    """Same for every turn of one conversation: the messages up to its first user message.

    Turn N+1 of a chat resends turn N's messages, so its prefix (system prompt and first
    question) is unchanged; the organisation's cache salt keeps tenants apart.
    """
    if request.chat is None:
        return None
    head: list[Any] = [request.chat.prompt] if request.chat.prompt is not None else []
    for message in request.chat.messages:
        head.append({"role": message.get("role"), "content": message.get("content")})
        if message.get("role") == "user":
            break
    data = orjson.dumps([request.cache_salt, head], default=str)
    return hashlib.blake2b(data, digest_size=16).digest()


def public_url(url: str) -> str:
    """The URL without user info or query (which may hold credentials)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
