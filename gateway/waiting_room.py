"""The pure admission state of one model: reservations in the engine and the waiting line.

A request either gets one of `capacity` reservations at once (counted the moment it is
decided, so the engine never holds more than it can run), waits in the bounded line, or is
refused with a reason. The order is by effective priority (tier + one level per `aging_s`
waited, counted from `Offer.arrival_s`, which a retry carries from its key's first refusal).
A full line takes a newcomer that would go before its tail and displaces the tail: nobody is
refused while someone of lower effective priority holds a place. Time comes from the
injected clock; no asyncio (`gateway.queue` adds the futures).
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import Reason
from gateway.priority_queue import PriorityQueue, QueueEntry
from settings import QueueConfig

Clock = Callable[[], float]
_EWMA_WEIGHT = 0.2  # weight of the newest admission interval in the moving average
_ARRIVAL_WINDOW_S = 10.0  # time constant of the per-priority arrival-rate average


@dataclass(frozen=True, slots=True)
class Offer:
    """One request asking for a place, in plain values."""

    request_id: str
    priority: int
    num_tokens: int
    key: str = ""
    max_running_per_key: int = 0  # wait (never refuse) while the key runs this many; 0: no cap
    wait_limit_s: float = math.inf  # refuse when the estimated wait is longer (load shedding)
    num_seqs: int = 1  # engine sequences it runs at once (n choices): its share of the capacity
    # When it started asking: a retry after a load refusal carries its key's first refusal
    # (gateway.retry_age), so it ranks as if it had waited since; None: it arrives now.
    arrival_s: float | None = None


class Outcome(enum.Enum):
    ADMITTED = "admitted"  # holds a reservation: may start in the engine now
    QUEUED = "queued"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Placement:
    outcome: Outcome
    reason: Reason | None = None  # why REFUSED
    retry_after_s: float = 0.0
    estimated_wait_s: float = 0.0
    displaced: tuple[str, ...] = ()  # waiting requests that lost their place to this one
    num_outranked_waiting: int = 0  # on refusal: waiting entries of a lower tier (aged past it)
    num_below_waiting: int = 0  # on refusal: waiting entries it goes before (only a token misfit)


class WaitingRoom:
    def __init__(self, config: QueueConfig, capacity: int, clock: Clock):
        """`capacity`: most reservations at once (the engine's batch size); 0: no limit."""
        self.config = config
        self.capacity = capacity
        self._clock = clock
        self._line = PriorityQueue(config.max_waiting_requests, config.max_waiting_tokens, config.aging_s)
        self._reserved: dict[str, tuple[str, int]] = {}  # request_id -> (key, num_seqs)
        self._num_reserved_seqs = 0
        self._running_by_key: Counter[str] = Counter()
        self._interval_s: float | None = None  # moving average of seconds between admissions
        self._last_admit_s: float | None = None
        self._backlog_since_s: float | None = None  # when the line last became non-empty
        self._arrivals: dict[int, _DecayingRate] = {}  # queued arrivals per second, by priority
        self.num_admitted = 0
        self.num_refused = 0
        self.num_displaced = 0
        self.num_cancelled = 0

    # -- reading -----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._line.num_waiting

    @property
    def num_waiting_tokens(self) -> int:
        return self._line.num_waiting_tokens

    @property
    def num_reserved(self) -> int:
        """Engine sequences reserved (a request with n choices holds n)."""
        return self._num_reserved_seqs

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._line

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def position(self, request_id: str) -> int | None:
        return self._line.position(request_id)

    def waiting(self) -> list[QueueEntry]:
        """The waiting entries, head first (their `arrival_s` is the carried one)."""
        return list(self._line)

    def waiting_by_priority(self) -> Counter[int]:
        return Counter(entry.priority for entry in self._line)

    def estimated_wait_s(self, priority: int | None = None, *, engine_has_room: bool = True) -> float:
        """Expected seconds before a new request of `priority` (None: lowest) gets a reservation."""
        if self._can_admit_now(engine_has_room, None):
            return 0.0
        return self._estimate_s(priority, self._clock())

    def estimated_wait_of_s(self, request_id: str) -> float | None:
        """For a waiting request: its place in line times the measured seconds per admission."""
        position = self._line.position(request_id)
        if position is None:
            return None
        return position * self._service_interval_s(self._clock())

    # -- deciding ----------------------------------------------------------------------
    def assess(self, offer: Offer, *, engine_has_room: bool = True) -> Placement:
        """What `place(offer)` would answer now; changes nothing."""
        now = self._clock()
        if self._can_admit_now(engine_has_room, offer):
            return Placement(Outcome.ADMITTED)
        arrival_s = _arrival_s(offer, now)
        wait_s = self._estimate_s(offer.priority, now, arrival_s)
        is_too_long = wait_s > offer.wait_limit_s
        # Past its wait limit, a request is shed only if nobody it goes before waits: else the
        # last of those (a lower tier, who would wait even longer) is shed in its place.
        victims = self._victims(offer, arrival_s, min_victims=1 if is_too_long else 0)
        if victims is None:
            reason, retry_after_s = (
                (Reason.WAIT_TOO_LONG, wait_s - offer.wait_limit_s)
                if is_too_long
                else (Reason.QUEUE_FULL, self._service_interval_s(now))
            )
            return Placement(
                Outcome.REFUSED,
                reason,
                max(1.0, retry_after_s),
                wait_s,
                num_outranked_waiting=self._num_outranked(offer.priority),
                num_below_waiting=sum(not self._line.goes_before(e, offer.priority, arrival_s) for e in self._line),
            )
        return Placement(Outcome.QUEUED, estimated_wait_s=wait_s, displaced=tuple(v.request_id for v in victims))

    def place(self, offer: Offer, *, engine_has_room: bool = True) -> Placement:
        """Reserve, queue (displacing lower entries from a full line) or refuse."""
        placement = self.assess(offer, engine_has_room=engine_has_room)
        now = self._clock()
        if placement.outcome is Outcome.ADMITTED:
            self._reserve(offer.request_id, offer.key, offer.num_seqs, now, is_sample=False)
        elif placement.outcome is Outcome.REFUSED:
            self.num_refused += 1
        else:
            for request_id in placement.displaced:
                self._line.remove(request_id)
                self.num_displaced += 1
            self._line.push(
                QueueEntry(
                    offer.request_id,
                    offer.priority,
                    _arrival_s(offer, now),
                    offer.num_tokens,
                    offer.key,
                    offer.max_running_per_key,
                    offer.num_seqs,
                )
            )
            self._arrivals.setdefault(offer.priority, _DecayingRate()).add(now)
            if self._backlog_since_s is None:
                self._backlog_since_s = now
        return placement

    def admit_ready(self, *, engine_has_room: bool = True) -> list[str]:
        """Give reservations to waiting requests, head first, while capacity lasts."""
        admitted: list[str] = []
        while engine_has_room and self._has_capacity():
            entry = self._line.first(self._is_eligible)
            if entry is None or not self._has_capacity(entry.num_seqs):
                break  # the head waits for room for all its sequences: nobody passes it
            self._line.remove(entry.request_id)
            self._reserve(entry.request_id, entry.key, entry.num_seqs, self._clock(), is_sample=True)
            admitted.append(entry.request_id)
        if not self._line:
            self._backlog_since_s = None
        return admitted

    def release(self, request_id: str) -> bool:
        """Free a reservation (the request finished) or a place in line (it left); once."""
        reserved = self._reserved.pop(request_id, None)
        if reserved is not None:
            key, num_seqs = reserved
            self._num_reserved_seqs -= num_seqs
            self._running_by_key[key] -= 1
            if self._running_by_key[key] <= 0:
                del self._running_by_key[key]
            return True
        if self._line.remove(request_id) is not None:
            self.num_cancelled += 1
            if not self._line:
                self._backlog_since_s = None
            return True
        return False

    # -- internals ---------------------------------------------------------------------
    def _has_capacity(self, num_seqs: int = 1) -> bool:
        """Room for `num_seqs` more sequences; one wider than the whole engine goes in alone."""
        if self.capacity <= 0 or not self._reserved:
            return True
        return self._num_reserved_seqs + num_seqs <= self.capacity

    def _is_eligible(self, entry: QueueEntry) -> bool:
        cap = entry.max_running_per_key
        return cap <= 0 or self._running_by_key[entry.key] < cap

    def _can_admit_now(self, engine_has_room: bool, offer: Offer | None) -> bool:
        if not (engine_has_room and self._has_capacity(1 if offer is None else offer.num_seqs)):
            return False
        if (
            offer is not None
            and offer.max_running_per_key > 0
            and self._running_by_key[offer.key] >= offer.max_running_per_key
        ):
            return False
        return self._line.first(self._is_eligible) is None  # nobody who could start is waiting

    def _victims(self, offer: Offer, arrival_s: float, *, min_victims: int = 0) -> list[QueueEntry] | None:
        """Tail entries this offer (arriving at `arrival_s`) goes before, by effective priority:
        at least `min_victims`, and enough to make room; None if there are not that many."""
        if offer.num_tokens > self._line.max_waiting_tokens:
            return None
        victims: list[QueueEntry] = []
        num_requests, num_tokens = self._line.num_waiting, self._line.num_waiting_tokens
        for entry in self._line.from_tail():
            if (
                len(victims) >= min_victims
                and num_requests < self._line.max_waiting_requests
                and num_tokens + offer.num_tokens <= self._line.max_waiting_tokens
            ):
                return victims
            if self._line.goes_before(entry, offer.priority, arrival_s):
                return None  # everyone left outranks (or has aged past) the newcomer
            victims.append(entry)
            num_requests, num_tokens = num_requests - 1, num_tokens - entry.num_tokens
        fits = (
            num_requests < self._line.max_waiting_requests
            and num_tokens + offer.num_tokens <= self._line.max_waiting_tokens
        )
        return victims if fits and len(victims) >= min_victims else None

    def _num_outranked(self, priority: int) -> int:
        return sum(1 for entry in self._line if entry.priority < priority)

    def _reserve(self, request_id: str, key: str, num_seqs: int, now: float, *, is_sample: bool) -> None:
        if is_sample:  # only waited-for admissions measure the service rate
            started_s = max(self._last_admit_s or -math.inf, self._backlog_since_s or -math.inf)
            interval_s = max(0.0, now - started_s)
            prev = self._interval_s
            self._interval_s = interval_s if prev is None else prev + _EWMA_WEIGHT * (interval_s - prev)
            self._last_admit_s = now
        self._reserved[request_id] = (key, num_seqs)
        self._num_reserved_seqs += num_seqs
        self._running_by_key[key] += 1
        self.num_admitted += 1

    def _estimate_s(self, priority: int | None, now: float, arrival_s: float | None = None) -> float:
        """(ahead + 1) admissions, plus one per higher-priority request that will arrive and
        cut in before this one has aged past its priority (gap * aging_s seconds after
        `arrival_s`, which a retry carries from its first refusal; None: now)."""
        interval_s = self._service_interval_s(now)
        if priority is None:
            priority = min(self._arrivals, default=0)
        arrival_s = now if arrival_s is None else arrival_s
        base_s = (self._line.num_ahead(priority, arrival_s) + 1) * interval_s
        cut_ins = [
            (rate.per_s(now), self._cut_in_window_s(q - priority, now - arrival_s))
            for q, rate in self._arrivals.items()
            if q > priority
        ]
        return _wait_with_cut_ins(base_s, interval_s, [c for c in cut_ins if c[0] > 0 and c[1] > 0])

    def _cut_in_window_s(self, priority_gap: int, age_s: float) -> float:
        """How much longer higher arrivals cut in ahead of a request already `age_s` old."""
        aging_s = self.config.aging_s
        return priority_gap * aging_s - age_s if aging_s > 0 else math.inf

    def _service_interval_s(self, now: float) -> float:
        """Seconds per admission: the moving average, or longer if admission has stalled."""
        average_s = self._interval_s or 0.0
        if self._backlog_since_s is None:
            return average_s
        stalled_s = now - max(self._last_admit_s or -math.inf, self._backlog_since_s)
        return max(average_s, stalled_s)


def _arrival_s(offer: Offer, now: float) -> float:
    return now if offer.arrival_s is None else min(offer.arrival_s, now)


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
