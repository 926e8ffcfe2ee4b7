"""A bounded per-model priority queue with aging, and the asyncio admission loop around it.

`PriorityQueue` is pure state (no clock, no asyncio) and is tested directly. `ModelQueue`
admits from its head whenever the backend says it has room; it never talks to the engine
beyond `has_room()`, and it never holds a request once that request is admitted.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from api.errors import ApiError, overloaded
from settings import QueueConfig

log = structlog.get_logger(__name__)

Clock = Callable[[], float]
_EWMA_WEIGHT = 0.2  # weight of the newest admission interval in the moving average
_HANDOFF_LOOP_TURNS = 3
_ARRIVAL_WINDOW_S = 10.0  # time constant of the per-priority arrival-rate average


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


class TicketState(enum.Enum):
    WAITING = "waiting"
    ADMITTED = "admitted"
    CANCELLED = "cancelled"


class QueueTicket:
    """One request's place in a ModelQueue: wait for admission, show position, or cancel."""

    __slots__ = ("_queue", "entry", "state", "admitted_s", "_admission", "_taken", "_close_reason")

    def __init__(self, queue: ModelQueue, entry: QueueEntry):
        self._queue = queue
        self.entry = entry
        self.state = TicketState.WAITING
        self.admitted_s: float | None = None
        self._admission: asyncio.Future[TicketState] = asyncio.get_running_loop().create_future()
        self._taken = asyncio.Event()  # set once the owner has seen the admission (or left)
        self._close_reason: QueueClosed | None = None

    @property
    def request_id(self) -> str:
        return self.entry.request_id

    @property
    def position(self) -> int | None:
        """1-based place in line while waiting (for SSE comments); None otherwise."""
        return self._queue._queue.position(self.request_id) if self.state is TicketState.WAITING else None

    @property
    def queue_time_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.entry.arrival_s

    async def wait(self, timeout_s: float | None = None) -> bool:
        """True once admitted; False if `timeout_s` passed first (still waiting).

        Start generating right after this returns True, with no await in between, so the
        backend's `has_room()` already counts this request when the next one is considered.
        Raises QueueClosed if the queue shut down or the ticket was cancelled; a cancelled
        caller gives up its place.
        """
        if not self._admission.done():
            try:
                done, _ = await asyncio.wait({self._admission}, timeout=timeout_s)
            except asyncio.CancelledError:
                self.cancel()
                raise
            if not done:
                return False
        if self._admission.result() is TicketState.ADMITTED:
            self._taken.set()
            return True
        raise self._close_reason or QueueClosed("The request left the queue.")

    def cancel(self) -> bool:
        """Leave the queue; True if this call removed a waiting entry. Safe at any time."""
        self._taken.set()
        if self.state is not TicketState.WAITING:
            return False
        self._queue._release(self)
        self._resolve(TicketState.CANCELLED)
        return True

    def _resolve(self, state: TicketState) -> None:
        self.state = state
        if not self._admission.done():
            self._admission.set_result(state)


class ModelQueue:
    """The waiting room in front of one model's backend.

    A dispatcher task admits from the head while `has_room()` is true, one hand-off at a
    time. It wakes on `notify()` (call it when a request finishes) and polls every
    `poll_interval_s` in case capacity freed without a notify.
    """

    def __init__(
        self,
        model_name: str,
        config: QueueConfig,
        has_room: Callable[[], bool],
        clock: Clock = time.monotonic,
        *,
        poll_interval_s: float = 0.05,
        handoff_timeout_s: float = 0.25,
    ):
        self.model_name = model_name
        self.config = config
        self._has_room = has_room
        self._clock = clock
        self._poll_interval_s = poll_interval_s
        self._handoff_timeout_s = handoff_timeout_s
        self._queue = PriorityQueue(config.max_waiting_requests, config.max_waiting_tokens, config.aging_s)
        self._tickets: dict[str, QueueTicket] = {}
        self._handoff: QueueTicket | None = None  # admitted, owner not yet resumed
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._is_closed = False
        self._interval_s: float | None = None  # moving average of seconds between admissions
        self._last_admit_s: float | None = None
        self._backlog_since_s: float | None = None  # when the queue last became non-empty
        self._arrivals: dict[int, _DecayingRate] = {}  # queued arrivals per second, by priority
        self.num_admitted = 0
        self.num_cancelled = 0
        self.num_rejected = 0

    @property
    def num_waiting(self) -> int:
        return self._queue.num_waiting

    @property
    def num_waiting_tokens(self) -> int:
        return self._queue.num_waiting_tokens

    def enqueue(self, request_id: str, priority: int, num_tokens: int) -> QueueTicket:
        """A ticket, already admitted when nobody waits and there is room.

        Raises QueueFull, WaitTooLong (estimate above config.max_wait_s) or QueueClosed.
        """
        if self._is_closed:
            raise QueueClosed("The server is shutting down.")
        now = self._clock()
        ticket = QueueTicket(self, QueueEntry(request_id, priority, now, num_tokens))
        if not self._queue and self._can_admit():
            self._admit(ticket, now, is_sample=False)
            return ticket
        try:
            self._queue.check_room(num_tokens)
            wait_s = self._estimate_s(priority, now)
            if wait_s > self.config.max_wait_s:
                raise WaitTooLong(
                    f"Estimated queue wait {wait_s:.0f}s exceeds {self.config.max_wait_s:.0f}s.",
                    retry_after_s=max(1.0, wait_s - self.config.max_wait_s),
                )
        except QueueError as exc:
            self.num_rejected += 1
            if isinstance(exc, QueueFull):
                exc.retry_after_s = max(1.0, self._service_interval_s(now))
            raise
        self._queue.push(ticket.entry)
        self._tickets[request_id] = ticket
        self._arrivals.setdefault(priority, _DecayingRate()).add(now)
        if self._backlog_since_s is None:
            self._backlog_since_s = now
        self._ensure_dispatcher()
        self._wake.set()
        return ticket

    def can_take(self, priority: int, num_tokens: int, wait_limit_s: float) -> bool:
        """Would a request be accepted now with an estimated wait within `wait_limit_s`?"""
        if self._is_closed:
            return False
        try:
            self._queue.check_room(num_tokens)
        except QueueFull:
            return False
        return self.estimated_wait_s(priority) <= min(wait_limit_s, self.config.max_wait_s)

    def estimated_wait_s(self, priority: int | None = None) -> float:
        """Expected seconds before a request of `priority` (None: lowest) would be admitted."""
        if not self._queue and self._can_admit():
            return 0.0
        return self._estimate_s(priority, self._clock())

    def _estimate_s(self, priority: int | None, now: float) -> float:
        """(ahead + 1) admissions, plus one per higher-priority request that will arrive and
        cut in before this one has aged past its priority (gap * aging_s seconds)."""
        interval_s = self._service_interval_s(now)
        if priority is None:
            priority = min(self._arrivals, default=0)
        base_s = (self._queue.num_ahead(priority, now) + 1) * interval_s
        cut_ins = [(rate.per_s(now), self._cut_in_window_s(q - priority))
                   for q, rate in self._arrivals.items() if q > priority]
        return _wait_with_cut_ins(base_s, interval_s, [c for c in cut_ins if c[0] > 0])

    def _cut_in_window_s(self, priority_gap: int) -> float:
        aging_s = self.config.aging_s
        return priority_gap * aging_s if aging_s > 0 else math.inf

    def notify(self) -> None:
        """Capacity may have freed (a request finished): look at the head now."""
        self._wake.set()

    async def start(self) -> None:
        self._ensure_dispatcher()

    async def stop(self) -> None:
        """Refuse new requests, fail every waiting ticket with QueueClosed, end the dispatcher."""
        self._is_closed = True
        self._wake.set()  # the dispatcher exits on its own even if a cancel is lost
        for ticket in list(self._tickets.values()):
            ticket._close_reason = QueueClosed("The server is shutting down.")
            ticket.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _ensure_dispatcher(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._dispatch(), name=f"queue-{self.model_name}")

    async def _dispatch(self) -> None:
        while not self._is_closed:
            try:
                await self._admit_while_room()
            except Exception:  # a failing has_room() must not kill admission for good
                log.exception("queue_dispatch_failed", model=self.model_name)
            await _wait_event(self._wake, self._poll_interval_s)
            self._wake.clear()

    async def _admit_while_room(self) -> None:
        while self._queue and self._can_admit() and not self._is_closed:
            entry = self._queue.pop_head()
            if entry is None:
                return
            ticket = self._tickets.pop(entry.request_id)
            self._admit(ticket, self._clock(), is_sample=True)
            if not self._queue:
                self._backlog_since_s = None
            # Let the owner reach the backend before has_room() is asked again: wait until it
            # has seen the admission, then a few loop turns for wrapper tasks (wait_for, a
            # coalescer's pump) to submit the request.
            if not await _wait_event(ticket._taken, self._handoff_timeout_s):
                log.warning("queue_handoff_slow", model=self.model_name, request_id=entry.request_id)
            for _ in range(_HANDOFF_LOOP_TURNS):
                await asyncio.sleep(0)

    def _can_admit(self) -> bool:
        handoff = self._handoff
        if handoff is not None and not handoff._taken.is_set():
            return False
        return self._has_room()

    def _admit(self, ticket: QueueTicket, now: float, *, is_sample: bool) -> None:
        if is_sample:  # only waited-for admissions measure the service rate
            started_s = max(self._last_admit_s or -math.inf, self._backlog_since_s or -math.inf)
            interval_s = max(0.0, now - started_s)
            prev = self._interval_s
            self._interval_s = interval_s if prev is None else prev + _EWMA_WEIGHT * (interval_s - prev)
            self._last_admit_s = now
        ticket.admitted_s = now
        ticket._resolve(TicketState.ADMITTED)
        self._handoff = ticket
        self.num_admitted += 1

    def _release(self, ticket: QueueTicket) -> None:
        if self._queue.remove(ticket.request_id) is not None:
            self._tickets.pop(ticket.request_id, None)
            self.num_cancelled += 1
        if not self._queue:
            self._backlog_since_s = None

    def _service_interval_s(self, now: float) -> float:
        """Seconds per admission: the moving average, or longer if admission has stalled."""
        average_s = self._interval_s or 0.0
        if self._backlog_since_s is None:
            return average_s
        stalled_s = now - max(self._last_admit_s or -math.inf, self._backlog_since_s)
        return max(average_s, stalled_s)


def _wait_with_cut_ins(base_s: float, interval_s: float, cut_ins: list[tuple[float, float]]) -> float:
    """Solve W = base + interval * sum(rate * min(W, window)) over (rate, window) pairs.

    W is piecewise linear: walk the windows upwards, capping each class W outlasts.
    """
    capped = 0.0  # sum of rate * window over the classes whose window W exceeds
    open_rate = sum(rate for rate, _ in cut_ins)
    for rate, window_s in sorted(cut_ins, key=lambda c: c[1]):
        denominator = 1.0 - interval_s * open_rate
        if denominator > 0:
            wait_s = (base_s + interval_s * capped) / denominator
            if wait_s <= window_s:
                return wait_s
        capped += rate * window_s  # inf when aging is off: the wait has no bound
        open_rate -= rate
    return base_s + interval_s * capped


class _DecayingRate:
    """Events per second, exponentially averaged with time constant _ARRIVAL_WINDOW_S."""

    __slots__ = ("_per_s", "_updated_s")

    def __init__(self) -> None:
        self._per_s = 0.0
        self._updated_s: float | None = None

    def add(self, now: float) -> None:
        self._per_s = self.per_s(now) + 1.0 / _ARRIVAL_WINDOW_S
        self._updated_s = now

    def per_s(self, now: float) -> float:
        if self._updated_s is None:
            return 0.0
        return self._per_s * math.exp(-max(0.0, now - self._updated_s) / _ARRIVAL_WINDOW_S)


async def _wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """True if `event` was set within `timeout_s` (asyncio.timeout: no lost cancels on 3.11)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
