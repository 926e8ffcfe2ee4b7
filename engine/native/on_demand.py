"""A native model loaded on its first request and unloaded when idle (models.<name>.idle_unload_s).

On a machine that serves several models but cannot hold them all in memory at once, a model
costs nothing until someone asks for it: the first request loads it (that request waits, its
stream sending heartbeats), and once `idle_unload_s` passed without a request running it is
unloaded and its memory freed (`unload`, Ollama's keep_alive 0, does it without the wait). Each
load is a fresh NativeBackend; its stop writes the prefix cache and the next load reads it back
(engine.prefix_cache_dir), so a model that comes back answers a known conversation warm.

One lock orders loads and unloads: a request arriving while the model unloads waits for the
unload, then loads it again. A failed load fails the requests waiting for it (a 5xx each) and
the next request tries again. The request-level seam (engine/types.Backend) is unchanged.
While unloaded, check_request knows only the context length: a request too large for the KV
pool is refused by the loaded engine, as an error in its stream rather than a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncGenerator, Callable

import structlog

from engine.native.backend import NativeBackend, trim_heap
from engine.types import EngineError, EngineStats, GenerationRequest, ModelLoadFailed, TokenEvent

log = structlog.get_logger(__name__)


class OnDemandBackend:
    def __init__(self, make: Callable[[], NativeBackend], *, idle_unload_s: float, name: str = ""):
        self._make = make
        self._idle_unload_s = idle_unload_s
        self._name = name
        self._next = make()  # not started: answers max_model_len and check_request before a load
        self._loaded: NativeBackend | None = None
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._num_running = 0  # requests between entering generate and leaving it
        self._idle_timer: asyncio.TimerHandle | None = None
        self._unloading: asyncio.Task[None] | None = None
        self._is_unload_asked = False  # unload when the running requests end, not idle_unload_s later
        self._is_stopped = False
        self._num_failed_loads = 0  # a request that waited through one fails with it (not a try of its own)
        # Memory of the model's kept outside the engine, freed with it (a vision model's prepared images).
        self.on_unload: Callable[[], None] | None = None
        self.num_loads = 0
        self.num_unloads = 0  # finished: the engine stopped and its memory handed back

    @property
    def is_loaded(self) -> bool:
        return self._loaded is not None

    @property
    def max_model_len(self) -> int:
        return self._next.max_model_len

    @property
    def runs_on_cpu(self) -> bool:  # loaded or not: its engine may step on the CPU at any time
        return self._next.runs_on_cpu

    @property
    def max_num_running(self) -> int:
        return self._next.max_num_running

    @property
    def engine(self):  # the loaded engine, for tests and benchmarks (None while unloaded)
        return None if self._loaded is None else self._loaded.engine

    async def start(self) -> None:
        """Nothing is loaded until the first request."""

    async def shutdown(self) -> None:
        self._is_stopped = True
        self._cancel_idle_timer()
        if self._unloading is not None:
            await asyncio.gather(self._unloading, return_exceptions=True)
        async with self._lock:
            await self._unload()

    def check_request(self, request: GenerationRequest) -> None:
        (self._loaded or self._next).check_request(request)

    def is_available(self) -> bool:
        return self._loaded.is_available() if self._loaded is not None else True

    def has_room(self) -> bool:
        # Unloaded: a request would load the model and start; the reservations bound how many.
        return self._loaded.has_room() if self._loaded is not None else not self._is_stopped

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        self._num_running += 1
        self._cancel_idle_timer()
        try:
            backend = await self._ensure_loaded()
            async with contextlib.aclosing(backend.generate(request)) as events:  # closing it aborts the request
                async for event in events:
                    yield event
        finally:
            self._num_running -= 1
            if self._num_running == 0 and not self._is_stopped:
                delay_s = 0.0 if self._is_unload_asked else self._idle_unload_s
                self._idle_timer = asyncio.get_running_loop().call_later(delay_s, self._start_unload)

    async def load(self) -> None:
        """Load now, with nothing to generate (Ollama's load call), so the next request does not
        wait for it; unused, it unloads idle_unload_s later as after a request. ModelLoadFailed
        as for a request."""
        self._is_unload_asked = False
        await self._ensure_loaded()
        if self._num_running == 0 and not self._is_stopped:
            self._cancel_idle_timer()
            self._idle_timer = asyncio.get_running_loop().call_later(self._idle_unload_s, self._start_unload)

    async def unload(self) -> None:
        """Unload now, or, with requests running on it, as soon as the last one ends (Ollama's
        keep_alive 0); the next request loads it again, as after an idle unload."""
        self._cancel_idle_timer()
        self._is_unload_asked = True
        await self._unload_if_idle()

    def abort(self, request_id: str) -> None:
        if self._loaded is not None:
            self._loaded.abort(request_id)

    def stats(self) -> EngineStats:
        return self._loaded.stats() if self._loaded is not None else EngineStats()

    def health(self) -> bool:
        return self._loaded.health() if self._loaded is not None else True

    async def _ensure_loaded(self) -> NativeBackend:
        num_failed_before = self._num_failed_loads
        async with self._lock:
            if self._is_stopped:
                raise EngineError(f"the model {self._name} is shutting down")
            if self._loaded is None:
                if self._num_failed_loads != num_failed_before:  # the load it waited for failed: its 503 too
                    raise ModelLoadFailed(self._name)
                backend, self._next = self._next, self._make()
                log.info("model_loading", model=self._name)
                try:
                    await backend.start()
                except Exception as exc:  # this request fails with a 503; the next one tries again
                    # The type and the traceback too: "division by zero" alone names no file or key.
                    error = f"{type(exc).__name__}: {exc}"
                    log.error("model_load_failed", model=self._name, error=error, exc_info=True)
                    self._num_failed_loads += 1
                    raise ModelLoadFailed(self._name) from exc
                self._loaded = backend
                self.num_loads += 1
            return self._loaded

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _start_unload(self) -> None:
        self._idle_timer = None
        if self._num_running == 0 and self._loaded is not None and not self._is_stopped:
            self._unloading = asyncio.get_running_loop().create_task(self._unload_if_idle())

    async def _unload_if_idle(self) -> None:
        async with self._lock:
            if self._num_running == 0:  # nobody came while the lock was waited for
                await self._unload()

    async def _unload(self) -> None:
        is_asked, self._is_unload_asked = self._is_unload_asked, False
        backend, self._loaded = self._loaded, None
        if backend is not None:
            log.info("model_unloading", model=self._name, idle_unload_s=self._idle_unload_s, is_asked=is_asked)
            await backend.shutdown()
            del backend
            if self.on_unload is not None:
                self.on_unload()
            await asyncio.to_thread(_give_memory_back)
            self.num_unloads += 1


def _give_memory_back() -> None:
    """Free the engine now (not at the next collection) and hand the C heap's free pages back."""
    gc.collect()
    trim_heap()
