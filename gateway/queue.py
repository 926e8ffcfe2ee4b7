"""The asyncio side of one model's `WaitingRoom`: a ticket per request that a handler awaits.

`ModelQueue` turns the room's decisions into futures: a ticket resolves when its request
gets a reservation, or fails with `Overloaded` when displaced or at shutdown. Releasing a
ticket (the request finished or left) frees its reservation and admits the next waiter at
once; a slow poll covers a backend that had no room when asked (`has_room()` is only a
hint on top of the reservations). The order is decided in the room, nowhere else.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

import structlog

from gateway.errors import Overloaded, Reason
from gateway.waiting_room import Offer, Outcome, Placement, WaitingRoom
from settings import QueueConfig

log = structlog.get_logger(__name__)

Clock = Callable[[], float]
UNAVAILABLE_RETRY_S = 5.0  # Retry-After while a model's backend cannot be reached


class TicketState(enum.Enum):
    WAITING = "waiting"
    ADMITTED = "admitted"  # holds a reservation until released
    RELEASED = "released"


class QueueTicket:
    """One request's claim on a ModelQueue: wait for a reservation, then release it once."""

    __slots__ = ("_queue", "request_id", "priority", "arrival_s", "state", "admitted_s", "_admission", "_failure")

    def __init__(self, queue: ModelQueue, offer: Offer, now: float):
        self._queue = queue
        self.request_id = offer.request_id
        self.priority = offer.priority
        self.arrival_s = now
        self.state = TicketState.WAITING
        self.admitted_s: float | None = None
        self._admission: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._failure: Overloaded | None = None

    @property
    def position(self) -> int | None:
        """1-based place in line while waiting (for SSE comments); None otherwise."""
        return self._queue.room.position(self.request_id)

    @property
    def estimated_wait_s(self) -> float | None:
        return self._queue.room.estimated_wait_of_s(self.request_id)

    @property
    def queue_time_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

    async def wait(self, timeout_s: float | None = None) -> bool:
        """True once admitted; False if `timeout_s` passed first (still waiting).

        Raises Overloaded if the request lost its place (displaced) or the queue stopped.
        A cancelled caller gives up its place.
        """
        if not self._admission.done():
            try:
                done, _ = await asyncio.wait({self._admission}, timeout=timeout_s)
            except asyncio.CancelledError:
                self.release()
                raise
            if not done:
                return False
        if self._failure is not None:
            raise self._failure
        return True

    def release(self) -> None:
        """Free the reservation or the place in line: the one release path, safe to repeat."""
        if self.state is TicketState.RELEASED:
            return
        self.state = TicketState.RELEASED
        self._queue._release(self)

    def _admit(self, now: float) -> None:
        self.state = TicketState.ADMITTED
        self.admitted_s = now
        if not self._admission.done():
            self._admission.set_result(None)

    def _fail(self, error: Overloaded) -> None:
        self.state = TicketState.RELEASED
        self._failure = error
        if not self._admission.done():
            self._admission.set_result(None)


class ModelQueue:
    """The waiting room in front of one model's backend, with its tickets."""

    def __init__(
        self,
        model_name: str,
        config: QueueConfig,
        has_room: Callable[[], bool],
        clock: Clock = time.monotonic,
        *,
        capacity: int = 0,
        poll_interval_s: float = 0.05,
        is_available: Callable[[], bool] = lambda: True,
    ):
        self.model_name = model_name
        self.config = config
        self.room = WaitingRoom(config, capacity, clock)
        self._has_room = has_room
        self._is_available = is_available  # False: the backend cannot be reached; the router falls back
        self._clock = clock
        self._poll_interval_s = poll_interval_s
        self._tickets: dict[str, QueueTicket] = {}
        self._poller: asyncio.Task[None] | None = None
        self._is_closed = False

    @property
    def num_waiting(self) -> int:
        return self.room.num_waiting

    @property
    def num_reserved(self) -> int:
        return self.room.num_reserved

    def assess(self, offer: Offer) -> Placement:
        if self._is_closed:
            return Placement(Outcome.REFUSED, Reason.SHUTTING_DOWN, 5.0)
        if not self._is_available():
            return Placement(Outcome.REFUSED, Reason.MODEL_UNAVAILABLE, UNAVAILABLE_RETRY_S)
        return self.room.assess(offer, engine_has_room=self._engine_has_room())

    def estimated_wait_s(self, priority: int | None = None) -> float:
        return self.room.estimated_wait_s(priority, engine_has_room=self._engine_has_room())

    def enqueue(self, offer: Offer) -> QueueTicket:
        """A ticket, already admitted when a reservation is free; raises Overloaded if refused."""
        if self._is_closed:
            raise Overloaded(Reason.SHUTTING_DOWN, "The server is shutting down.", retry_after_s=5.0)
        if not self._is_available():
            raise refusal(Placement(Outcome.REFUSED, Reason.MODEL_UNAVAILABLE, UNAVAILABLE_RETRY_S))
        placement = self.room.place(offer, engine_has_room=self._engine_has_room())
        if placement.outcome is Outcome.REFUSED:
            raise refusal(placement)
        ticket = QueueTicket(self, offer, self._clock())
        self._tickets[offer.request_id] = ticket
        for request_id in placement.displaced:
            log.info("queue_displaced", model=self.model_name, request_id=request_id, by=offer.request_id)
            self._tickets.pop(request_id)._fail(
                Overloaded(
                    Reason.DISPLACED,
                    "A request of a higher tier took this request's place in the queue; retry later.",
                    retry_after_s=placement.retry_after_s or 1.0,
                )
            )
        if placement.outcome is Outcome.ADMITTED:
            self._tickets.pop(offer.request_id)._admit(ticket.arrival_s)
        else:
            self._admit_ready()
        return ticket

    def notify(self) -> None:
        """Capacity may have freed outside a release (the backend's own hint): look again."""
        self._admit_ready()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        """Refuse new requests and fail every waiting ticket with SHUTTING_DOWN."""
        self._is_closed = True
        for ticket in list(self._tickets.values()):
            self.room.release(ticket.request_id)
            ticket._fail(Overloaded(Reason.SHUTTING_DOWN, "The server is shutting down.", retry_after_s=5.0))
        self._tickets.clear()
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None

    def _release(self, ticket: QueueTicket) -> None:
        self._tickets.pop(ticket.request_id, None)
        self.room.release(ticket.request_id)
        self._admit_ready()

    def _admit_ready(self) -> None:
        """Hand free reservations to the head of the line; poll if the backend said no room."""
        if self._is_closed:
            return
        has_room = self._engine_has_room()
        now = self._clock()
        for request_id in self.room.admit_ready(engine_has_room=has_room):
            self._tickets.pop(request_id)._admit(now)
        if self.room.num_waiting and not has_room and (self._poller is None or self._poller.done()):
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name=f"queue-{self.model_name}")

    async def _poll(self) -> None:
        while not self._is_closed and self.room.num_waiting:
            await asyncio.sleep(self._poll_interval_s)
            if not self._is_available():  # the engine died: nothing waiting will ever be admitted
                self._fail_waiting(refusal(Placement(Outcome.REFUSED, Reason.MODEL_UNAVAILABLE, UNAVAILABLE_RETRY_S)))
                return
            if self._engine_has_room():
                self._admit_ready()

    def _fail_waiting(self, error: Overloaded) -> None:
        for request_id, ticket in list(self._tickets.items()):
            if ticket.state is TicketState.WAITING:
                self._tickets.pop(request_id)
                self.room.release(request_id)
                ticket._fail(error)

    def _engine_has_room(self) -> bool:
        try:
            return self._has_room()
        except Exception:  # a failing hint must not stop admission: the reservations still bound it
            log.exception("queue_has_room_failed", model=self.model_name)
            return True


def refusal(placement: Placement) -> Overloaded:
    if placement.reason is Reason.WAIT_TOO_LONG:
        message = f"Estimated queue wait {placement.estimated_wait_s:.0f}s is too long for this tier; retry later."
    elif placement.reason is Reason.SHUTTING_DOWN:
        message = "The server is shutting down."
    elif placement.reason is Reason.MODEL_UNAVAILABLE:
        message = "The model cannot be reached right now; retry after the time in Retry-After."
    else:
        message = "The queue is full of requests of your tier or higher; retry after the time in Retry-After."
    return Overloaded(
        placement.reason or Reason.QUEUE_FULL,
        message,
        retry_after_s=placement.retry_after_s,
        num_outranked_waiting=placement.num_outranked_waiting,
        num_below_waiting=placement.num_below_waiting,
    )
