"""The pure waiting-room state of one model: a bounded priority queue with aging.

No clock, no asyncio: callers pass arrival times in, and tests drive it directly. Also
owns the queue's refusals (503 with Retry-After); `gateway.queue` adds the admission loop.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from api.errors import ApiError, overloaded

MAX_RETRY_AFTER_S = 60.0  # the openai SDK waits at most 60 s (v1) for a Retry-After


class QueueError(Exception):
    """The queue refused or dropped a request: a 503 with Retry-After, before any stream opens."""

    code = "server_overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retry_after_s(self) -> float:
        return self._retry_after_s

    @retry_after_s.setter
    def retry_after_s(self, seconds: float) -> None:
        self._retry_after_s = min(max(1.0, seconds), MAX_RETRY_AFTER_S)  # also turns inf into a number

    def to_api_error(self) -> ApiError:
        return overloaded(self.message, retry_after_s=self.retry_after_s, code=self.code)


class QueueFull(QueueError):
    code = "queue_full"


class WaitTooLong(QueueError):
    code = "queue_wait_too_long"


class QueueClosed(QueueError):
    code = "server_shutting_down"


@dataclass(frozen=True, slots=True)
class QueueEntry:
    request_id: str
    priority: int  # the tier's priority; higher goes first
    arrival_s: float
    num_tokens: int  # prompt + max_tokens, counted against max_waiting_tokens


class PriorityQueue:
    """Waiting entries ordered by effective priority = priority + wait_s / aging_s.

    Every entry ages at the same rate, so the order never changes with time: it equals the
    order of `arrival_s - priority * aging_s` (one priority level is worth a head start of
    `aging_s` seconds). A low-priority entry therefore passes every higher one that arrives
    more than (priority gap) * aging_s after it: its wait is bounded. aging_s <= 0 turns
    aging off (strict priority, FIFO within a priority).
    """

    def __init__(self, max_waiting_requests: int, max_waiting_tokens: int, aging_s: float):
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.aging_s = aging_s
        self._heap: list[tuple[float, float, int, str]] = []  # (key, key, seq, request_id)
        self._live: dict[str, tuple[QueueEntry, int]] = {}  # request_id -> (entry, seq)
        self._seq = 0
        self.num_waiting_tokens = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    @property
    def num_waiting(self) -> int:
        return len(self._live)

    def check_room(self, num_tokens: int) -> None:
        """Raise QueueFull if an entry of `num_tokens` would break a bound."""
        if len(self._live) >= self.max_waiting_requests:
            raise QueueFull(f"The queue is full ({self.max_waiting_requests} requests waiting).")
        if self.num_waiting_tokens + num_tokens > self.max_waiting_tokens:
            raise QueueFull(f"The queue is full ({self.num_waiting_tokens} tokens waiting).")

    def push(self, entry: QueueEntry) -> None:
        if entry.request_id in self._live:
            raise ValueError(f"request {entry.request_id!r} is already queued")
        self.check_room(entry.num_tokens)
        self._seq += 1
        self._live[entry.request_id] = (entry, self._seq)
        self.num_waiting_tokens += entry.num_tokens
        heapq.heappush(self._heap, (*self._sort_key(entry.priority, entry.arrival_s), self._seq, entry.request_id))

    def pop_head(self) -> QueueEntry | None:
        while self._heap:
            *_, seq, request_id = heapq.heappop(self._heap)
            live = self._live.get(request_id)
            if live is not None and live[1] == seq:  # else a stale item left by remove()
                return self._forget(request_id)
        return None

    def peek_head(self) -> QueueEntry | None:
        while self._heap:
            *_, seq, request_id = self._heap[0]
            live = self._live.get(request_id)
            if live is not None and live[1] == seq:
                return live[0]
            heapq.heappop(self._heap)
        return None

    def remove(self, request_id: str) -> QueueEntry | None:
        """Drop a waiting entry (its heap item goes stale and is skipped later)."""
        if request_id not in self._live:
            return None
        entry = self._forget(request_id)
        if len(self._heap) > 2 * len(self._live) + 64:  # keep stale items from piling up
            self._heap = [item for item in self._heap if self._is_live(item)]
            heapq.heapify(self._heap)
        return entry

    def position(self, request_id: str) -> int | None:
        """1 for the head; None when not waiting."""
        live = self._live.get(request_id)
        if live is None:
            return None
        entry, seq = live
        key = (*self._sort_key(entry.priority, entry.arrival_s), seq)
        return 1 + sum(1 for e, s in self._live.values() if (*self._sort_key(e.priority, e.arrival_s), s) < key)

    def num_ahead(self, priority: int, arrival_s: float) -> int:
        """How many waiting entries would stay ahead of a new entry pushed now."""
        key = self._sort_key(priority, arrival_s)
        return sum(1 for e, _ in self._live.values() if self._sort_key(e.priority, e.arrival_s) <= key)

    def effective_priority(self, entry: QueueEntry, now_s: float) -> float:
        if self.aging_s <= 0:
            return float(entry.priority)
        return entry.priority + (now_s - entry.arrival_s) / self.aging_s

    def _sort_key(self, priority: int, arrival_s: float) -> tuple[float, float]:
        if self.aging_s <= 0:
            return (-priority, arrival_s)
        return (arrival_s - priority * self.aging_s, 0.0)

    def _is_live(self, item: tuple[float, float, int, str]) -> bool:
        live = self._live.get(item[3])
        return live is not None and live[1] == item[2]

    def _forget(self, request_id: str) -> QueueEntry:
        entry, _ = self._live.pop(request_id)
        self.num_waiting_tokens -= entry.num_tokens
        return entry
