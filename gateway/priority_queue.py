"""The waiting line of one model: entries ordered by priority with aging, bounded in size.

No clock, no asyncio: callers pass arrival and current times in, and tests drive it
directly. `gateway.waiting_room` adds reservations, displacement and wait estimates on top.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueEntry:
    request_id: str
    priority: int  # the tier's priority; higher goes first
    arrival_s: float
    num_tokens: int  # prompt + max_tokens, counted against max_waiting_tokens
    key: str = ""  # the caller (API key), for a per-key cap on running requests
    max_running_per_key: int = 0  # this entry waits while its key runs this many; 0: no cap
    num_seqs: int = 1  # engine sequences it will run (n choices)


class PriorityQueue:
    """Waiting entries ordered by effective priority = priority + wait_s / aging_s.

    Every entry ages at the same rate, so the order never changes with time: it equals the
    order of `arrival_s - priority * aging_s` (one priority level is worth a head start of
    `aging_s` seconds). A low-priority entry therefore passes every higher one that arrives
    more than (priority gap) * aging_s after it: its wait is bounded. aging_s <= 0 turns
    aging off (strict priority, FIFO within a priority). The line is a sorted list: queues
    hold hundreds of entries, and the tail (for displacement) is as cheap as the head.
    """

    def __init__(self, max_waiting_requests: int, max_waiting_tokens: int, aging_s: float):
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.aging_s = aging_s
        self._line: list[tuple[float, float, int]] = []  # (sort key, sort key, seq), head first
        self._by_seq: dict[int, QueueEntry] = {}
        self._seq_of: dict[str, int] = {}  # request_id -> seq
        self._seq = 0
        self.num_waiting_tokens = 0

    def __len__(self) -> int:
        return len(self._line)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seq_of

    def __iter__(self) -> Iterator[QueueEntry]:
        """Entries from the head to the tail (do not push or remove while iterating)."""
        return (self._by_seq[item[2]] for item in self._line)

    def from_tail(self) -> Iterator[QueueEntry]:
        return (self._by_seq[item[2]] for item in reversed(self._line))

    @property
    def num_waiting(self) -> int:
        return len(self._line)

    def has_room(self, num_tokens: int) -> bool:
        return (
            len(self._line) < self.max_waiting_requests
            and self.num_waiting_tokens + num_tokens <= self.max_waiting_tokens
        )

    def push(self, entry: QueueEntry) -> None:
        if entry.request_id in self._seq_of:
            raise ValueError(f"request {entry.request_id!r} is already queued")
        if not self.has_room(entry.num_tokens):
            raise ValueError(f"no room for {entry.request_id!r}: check has_room() first")
        self._seq += 1
        self._by_seq[self._seq] = entry
        self._seq_of[entry.request_id] = self._seq
        self.num_waiting_tokens += entry.num_tokens
        bisect.insort(self._line, (*self.sort_key(entry.priority, entry.arrival_s), self._seq))

    def pop_head(self) -> QueueEntry | None:
        return self.remove(self._by_seq[self._line[0][2]].request_id) if self._line else None

    def peek_head(self) -> QueueEntry | None:
        return self._by_seq[self._line[0][2]] if self._line else None

    def peek_tail(self) -> QueueEntry | None:
        return self._by_seq[self._line[-1][2]] if self._line else None

    def first(self, is_eligible: Callable[[QueueEntry], bool]) -> QueueEntry | None:
        """The entry nearest the head for which `is_eligible` holds."""
        return next((entry for entry in self if is_eligible(entry)), None)

    def remove(self, request_id: str) -> QueueEntry | None:
        seq = self._seq_of.pop(request_id, None)
        if seq is None:
            return None
        entry = self._by_seq.pop(seq)
        item = (*self.sort_key(entry.priority, entry.arrival_s), seq)
        del self._line[bisect.bisect_left(self._line, item)]
        self.num_waiting_tokens -= entry.num_tokens
        return entry

    def position(self, request_id: str) -> int | None:
        """1 for the head; None when not waiting."""
        seq = self._seq_of.get(request_id)
        if seq is None:
            return None
        entry = self._by_seq[seq]
        return 1 + bisect.bisect_left(self._line, (*self.sort_key(entry.priority, entry.arrival_s), seq))

    def num_ahead(self, priority: int, arrival_s: float) -> int:
        """How many waiting entries would stay ahead of a new entry pushed now."""
        return bisect.bisect_right(self._line, (*self.sort_key(priority, arrival_s), self._seq + 1))

    def goes_before(self, entry: QueueEntry, priority: int, arrival_s: float) -> bool:
        """Would `entry` stay ahead of a new entry (priority, arrival_s)?"""
        return self.sort_key(entry.priority, entry.arrival_s) <= self.sort_key(priority, arrival_s)

    def effective_priority(self, entry: QueueEntry, now_s: float) -> float:
        if self.aging_s <= 0:
            return float(entry.priority)
        return entry.priority + (now_s - entry.arrival_s) / self.aging_s

    def sort_key(self, priority: int, arrival_s: float) -> tuple[float, float]:
        if self.aging_s <= 0:
            return (-priority, arrival_s)
        return (arrival_s - priority * self.aging_s, 0.0)
