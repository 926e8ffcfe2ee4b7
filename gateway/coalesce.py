"""Identical greedy requests in flight share one generation (the viral-prompt case).

Same backend, prompt token ids, sampling params (temperature 0) and cache salt: one backend
request, whose events fan out to every waiter, late joiners replaying what they missed. A
waiter leaving never aborts the others; the last one leaving aborts the generation. Billing
stays per waiter: each sees the full cumulative counts on every event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import structlog

from engine.types import Backend, GenerationRequest, SamplingParams, TokenEvent

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class CoalesceKey:
    backend_id: int  # id() of the backend; the shared generation holds the backend, so the id stays unique
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # with seed cleared: greedy output does not depend on it
    cache_salt: str | None
    image_hashes: tuple[str, ...] = ()  # a vision prompt: same token ids, different pictures, different answers


class _SharedGeneration:
    """One shared generation: the events so far and who is listening."""

    __slots__ = ("key", "backend", "request_id", "events", "is_done", "error", "num_waiters", "changed", "task")

    def __init__(self, key: CoalesceKey, backend: Backend, request_id: str):
        self.key = key
        self.backend = backend
        self.request_id = request_id
        self.events: list[TokenEvent] = []
        self.is_done = False
        self.error: BaseException | None = None
        self.num_waiters = 0
        self.changed = asyncio.Event()  # replaced on every change; waiters hold the old one
        self.task: asyncio.Task[None] | None = None

    def publish(self, event: TokenEvent | None = None, *, error: BaseException | None = None) -> None:
        if event is not None:
            self.events.append(event)
        else:
            self.is_done, self.error = True, error
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class Coalescer:
    def __init__(self) -> None:
        self._generations: dict[CoalesceKey, _SharedGeneration] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # strong refs: the loop only keeps weak ones
        self.num_generations = 0  # backend generations started for coalescable requests
        self.num_joined = 0  # requests served by a generation another request started

    @property
    def num_in_flight(self) -> int:
        return len(self._generations)

    async def generate(self, backend: Backend, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """`backend.generate(request)`, shared with identical greedy requests in flight.

        Close it with `aclose()` (or `contextlib.aclosing`) when leaving early; never call
        `backend.abort()` for a coalesced request: the generation may belong to others too.
        """
        if not request.sampling.is_greedy:
            async with contextlib.aclosing(backend.generate(request)) as events:
                async for event in events:
                    yield event
            return
        key = _key(backend, request)
        generation = self._generations.get(key)
        if generation is None:
            generation = self._start(key, backend, request)
        else:
            self.num_joined += 1
            log.debug("coalesce_join", request_id=request.request_id, generation_id=generation.request_id)
        generation.num_waiters += 1
        try:
            index = 0
            while True:
                if index < len(generation.events):
                    index += 1
                    yield generation.events[index - 1]
                elif generation.is_done:
                    if generation.error is not None:
                        raise generation.error
                    return
                else:
                    await generation.changed.wait()
        finally:
            generation.num_waiters -= 1
            if generation.num_waiters == 0 and not generation.is_done:
                self._abandon(generation)

    def _start(self, key: CoalesceKey, backend: Backend, request: GenerationRequest) -> _SharedGeneration:
        generation = _SharedGeneration(key, backend, request.request_id)
        self._generations[key] = generation
        generation.task = asyncio.get_running_loop().create_task(self._run_generation(generation, request))
        self._tasks.add(generation.task)
        generation.task.add_done_callback(self._tasks.discard)
        self.num_generations += 1
        return generation

    async def _run_generation(self, generation: _SharedGeneration, request: GenerationRequest) -> None:
        """Runs the one backend generation; closing its iterator (on cancel) aborts it."""
        try:
            async with contextlib.aclosing(generation.backend.generate(request)) as events:
                async for event in events:
                    generation.publish(event)
        except asyncio.CancelledError:
            raise  # abandoned: nobody is listening
        except Exception as exc:  # delivered to every waiter; each renders its own error
            self._forget(generation)
            generation.publish(error=exc)
        else:
            self._forget(generation)
            generation.publish()

    def _abandon(self, generation: _SharedGeneration) -> None:
        self._forget(generation)
        generation.is_done = True
        if generation.task is not None:
            generation.task.cancel()
        log.debug("coalesce_abandoned", generation_id=generation.request_id)

    def _forget(self, generation: _SharedGeneration) -> None:
        """A finished or abandoned generation takes no new waiters."""
        if self._generations.get(generation.key) is generation:
            del self._generations[generation.key]


def _key(backend: Backend, request: GenerationRequest) -> CoalesceKey:
    sampling = dataclasses.replace(request.sampling, seed=None)
    images = tuple(img.content_hash for img in request.images)
    return CoalesceKey(id(backend), request.prompt_token_ids, sampling, request.cache_salt, images)
