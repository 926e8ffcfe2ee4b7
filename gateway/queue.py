"""The asyncio admission loop in front of one model's backend, around a `PriorityQueue`.

`ModelQueue` admits from the head whenever the backend says it has room and estimates
waits from the measured admission rate; it never talks to the engine beyond `has_room()`
and never holds a request once admitted. The pure queue lives in `gateway.priority_queue`.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Callable

import structlog

from gateway.priority_queue import (  # re-exported: the queue's public names live here too
    MAX_RETRY_AFTER_S,
    PriorityQueue,
    QueueClosed,
    QueueEntry,
    QueueError,
    QueueFull,
    WaitTooLong,
)
from settings import QueueConfig

__all__ = [
    "MAX_RETRY_AFTER_S", "ModelQueue", "PriorityQueue", "QueueClosed", "QueueEntry", "QueueError",
    "QueueFull", "QueueTicket", "TicketState", "WaitTooLong",
]

log = structlog.get_logger(__name__)

Clock = Callable[[], float]
_EWMA_WEIGHT = 0.2  # weight of the newest admission interval in the moving average
_HANDOFF_LOOP_TURNS = 3
_ARRIVAL_WINDOW_S = 10.0  # time constant of the per-priority arrival-rate average


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
