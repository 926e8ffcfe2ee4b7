"""NativeBackend: the Backend protocol over LLMEngine, stepped by its device's step thread.

The event loop never runs torch: requests and aborts go to the step thread through an inbox;
each step's outputs come back in one call_soon_threadsafe, where they are detokenized (stop
strings included) and fanned out to per-request queues. Closing a request's iterator aborts
it; its blocks are freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import queue
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import ClassVar

import structlog

from engine.detokenizer import IncrementalDetokenizer, LogprobGate
from engine.native import prefix_store
from engine.native.llm_engine import LLMEngine, RequestOutput
from engine.native.loader import load_model_args
from engine.tokenizer import Tokenizer
from engine.torch_threads import PoolOwner
from engine.types import (
    EngineError,
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestRejected,
    TokenEvent,
    check_fits_context,
)
from settings import EngineConfig

log = structlog.get_logger(__name__)

_MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass(frozen=True, slots=True)
class _Add:
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Failure:
    request_id: str
    error: Exception


class _Stop:
    pass


class _Stream:
    """The loop-side state of one request: its queue, detokenizer and last counts."""

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer):
        self.queue: asyncio.Queue[TokenEvent | Exception] = asyncio.Queue()
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.sampling.stop, request.prompt_token_ids)
        self.last = TokenEvent("", (), len(request.prompt_token_ids), 0, 0)
        self.done = False
        self._logprobs = LogprobGate()  # a token's logprob goes out with its text

    def advance(self, out: RequestOutput) -> TokenEvent:
        text, hit_stop = self.detokenizer.push(out.new_token_ids)
        reason = FinishReason.STOP if hit_stop else out.finish_reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH) and not hit_stop:
            text += self.detokenizer.flush()
        self.last = TokenEvent(
            text,
            out.new_token_ids,
            out.num_prompt_tokens,
            out.num_cached_tokens,
            out.num_completion_tokens,
            reason,
            logprobs=self._logprobs.release(out.logprobs, self.detokenizer.num_tokens_emitted),
            prompt_logprobs=out.prompt_logprobs,
            stop_str=self.detokenizer.matched_stop if hit_stop else None,
        )
        self.done = reason is not None
        return self.last

    def finish_aborted(self) -> None:
        if not self.done:
            self.done = True
            self.queue.put_nowait(replace(self.last, text="", token_ids=(), finish_reason=FinishReason.ABORT))


class _Tick(Enum):
    """What one turn of the step thread left for this engine."""

    BUSY = "busy"  # requests are still running: step again soon
    IDLE = "idle"  # nothing to run: the thread may sleep until new work arrives
    DONE = "done"  # the engine stopped (shutdown, its event loop gone, or too many failed steps)


class NativeBackend:
    def __init__(
        self,
        model_dir: Path | str,
        config: EngineConfig,
        tokenizer: Tokenizer,
        *,
        max_model_len: int | None = None,
        prefix_cache_dir: Path | None = None,  # the prefix cache kept across restarts (prefix_store.py); None: not
    ):
        self._model_dir = Path(model_dir)
        self._prefix_cache_dir = prefix_cache_dir
        self._config = config
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len or load_model_args(self._model_dir).max_position_embeddings
        self._engine: LLMEngine | None = None
        self._streams: dict[str, _Stream] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stepper: _StepThread | None = None
        self._stopped = threading.Event()  # set by the step thread once this engine left it
        self._failures = 0  # consecutive failed steps
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = EngineStats()
        self._stopping = False
        self._dead = False
        self._mean_prompt_tokens = 256.0  # running estimate for has_room()

    @property
    def runs_on_cpu(self) -> bool:
        """Whether this engine steps on the CPU (engine.device resolved), so that other torch work
        in the process must take turns on its threads (engine/torch_threads.PoolOwner)."""
        from engine.native.runner import resolve_device

        try:
            return resolve_device(self._config.device).type == "cpu"
        except EngineError:  # CUDA asked for but absent: the engine will not start
            return False

    @property
    def max_model_len(self) -> int:
        """The context a request may use: the model's (or the configured max_model_len), or less
        once started where the whole KV cache holds fewer tokens (a sequence can never outgrow
        it), so default max_tokens, history trimming and /v1/models follow what can run."""
        engine = self._engine
        return self._max_model_len if engine is None else min(self._max_model_len, engine.max_sequence_tokens)

    @property
    def max_num_running(self) -> int:
        return self._config.max_num_seqs

    @property
    def engine(self) -> LLMEngine | None:
        """The engine, for tests and benchmarks; only the step thread may call into it."""
        return self._engine

    async def start(self) -> None:
        """Load the model in its device's step thread and wait until it is ready (or failed).

        Every native engine on one device is built and stepped by one shared thread, round-robin
        (see _StepThread): with GNU OpenMP (torch's CPU threading) each thread that runs
        multi-threaded torch ops keeps its own worker pool, and once a process has more pool
        threads than cores each parallel region hands work over through the kernel instead of
        spinning, about 80 us per op on the 2-core development machine, a third of a small
        decode step. Two models in two threads would pay that on every op.
        """
        from engine.native.runner import resolve_device

        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[EngineStats] = self._loop.create_future()
        self._stepper = _StepThread.attach(str(resolve_device(self._config.device)), self, ready)
        try:
            self._stats = await ready
            if self._engine is not None and self._engine.max_sequence_tokens < self._max_model_len:
                log.warning(
                    "kv_cache_smaller_than_context",
                    model_dir=str(self._model_dir),
                    context_tokens=self._max_model_len,
                    kv_cache_tokens=self._engine.max_sequence_tokens,
                    hint="requests are limited to what the cache holds; raise engine.kv_cache_bytes "
                    "or engine.kv_cache_memory_fraction, or lower models.<name>.max_model_len",
                )
        except BaseException:
            # Failed, or cancelled while loading: a model that still finishes loading finds this
            # _Stop first in its inbox and leaves the step thread at once.
            self._post(_Stop())
            self._stepper = None
            raise

    async def shutdown(self) -> None:
        self._stopping = True
        stepper = self._stepper
        if stepper is not None:
            for request_id in list(self._streams):
                self._post(_Abort(request_id))
            self._post(_Stop())
            await asyncio.to_thread(self._wait_stopped, stepper)
            await asyncio.sleep(0)  # let the last posted outputs reach their streams
        for stream in self._streams.values():
            stream.finish_aborted()
        engine, self._engine = self._engine, None
        if engine is not None and engine.runner.device.type == "cuda":
            import torch

            del engine
            torch.cuda.empty_cache()

    def _wait_stopped(self, stepper: _StepThread) -> None:
        while not self._stopped.wait(0.1):
            if not stepper.thread.is_alive():  # the thread itself died: nothing will stop us
                return

    def check_request(self, request: GenerationRequest) -> None:
        if self._engine is not None:
            self._engine.check_request(request)
            return
        check_fits_context(request, self._max_model_len)

    def has_room(self) -> bool:
        """Nothing waits in the engine, a batch slot is free, and a typical prompt's blocks are free."""
        if self._engine is None or self._stopping or self._dead:
            return False
        stats = self._stats
        blocks_needed = math.ceil(self._mean_prompt_tokens / self._config.block_size) + 1
        return (
            stats.num_waiting == 0
            and len(self._streams) < self._config.max_num_seqs
            and stats.num_kv_blocks_free >= blocks_needed
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        if self._engine is None or self._stopping or self._dead:
            raise EngineError("the native engine is not running")
        self._engine.check_request(request)
        if request.request_id in self._streams:
            raise RequestRejected(f"request id {request.request_id!r} is already running", param="request_id")
        stream = _Stream(request, self._tokenizer)
        self._streams[request.request_id] = stream
        self._mean_prompt_tokens += (len(request.prompt_token_ids) - self._mean_prompt_tokens) / 16
        self._post(_Add(request))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if self._streams.get(request.request_id) is stream:
                del self._streams[request.request_id]
            if not stream.done:  # closed early (client gone, cancelled): free it in the engine
                stream.done = True
                self._post(_Abort(request.request_id))

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._post(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def health(self) -> bool:
        return not self._dead and (self._stepper is None or self._stepper.thread.is_alive() or self._stopping)

    def is_available(self) -> bool:
        """False once the engine died (failed steps, its thread gone): the queue answers 503 (or the
        router falls back) instead of holding requests for an engine that will never take them."""
        return self.health()

    # -- loop side -------------------------------------------------------------------------

    def _post(self, item: _Add | _Abort | _Stop) -> None:
        self._inbox.put(item)
        if self._stepper is not None:
            self._stepper.wakeup.set()

    def _dispatch(self, items: list[RequestOutput | _Failure]) -> None:
        for item in items:
            stream = self._streams.get(item.request_id)
            if stream is None or stream.done:
                continue
            if isinstance(item, _Failure):
                stream.done = True
                stream.queue.put_nowait(item.error)
                continue
            event = stream.advance(item)
            if event.finish_reason is FinishReason.STOP and item.finish_reason is None:
                self._post(_Abort(item.request_id))  # a stop string ended it: free the sequence
            stream.queue.put_nowait(event)

    # -- step thread -----------------------------------------------------------------------

    def _build(self, ready: asyncio.Future) -> LLMEngine | None:
        def settle(outcome: EngineStats | BaseException) -> None:
            if ready.done():
                return
            if isinstance(outcome, BaseException):
                ready.set_exception(outcome)
            else:
                ready.set_result(outcome)

        loop = self._loop
        assert loop is not None  # start() sets it before handing the backend to the step thread
        try:
            engine = LLMEngine.from_model_dir(
                self._model_dir,
                self._config,
                eos_token_ids=self._tokenizer.eos_token_ids,
                max_model_len=self._max_model_len,
            )
        except BaseException as exc:  # reported to start(), which re-raises it
            loop.call_soon_threadsafe(settle, exc)
            return None
        self._engine = engine
        self._restore_prefix_cache(engine)
        loop.call_soon_threadsafe(settle, engine.stats())
        return engine

    def _prefix_cache_file(self, engine: LLMEngine) -> Path | None:
        directory = self._prefix_cache_dir
        return None if directory is None else prefix_store.file_for(directory, engine, self._model_dir)

    def _restore_prefix_cache(self, engine: LLMEngine) -> None:
        """Warm the prefix cache from the last clean stop (engine/native/prefix_store.py)."""
        try:
            path = self._prefix_cache_file(engine)
            if path is not None:
                num = prefix_store.restore(engine, self._model_dir, path)
                if num:
                    log.info("prefix_cache_restored", blocks=num, path=str(path))
        except Exception:  # warmth only: a failure here must not stop the model from serving
            log.exception("prefix_cache_restore_failed")

    def _save_prefix_cache(self, engine: LLMEngine) -> None:
        try:
            path = self._prefix_cache_file(engine)
            if path is not None:
                num = prefix_store.save(engine, self._model_dir, path, self._config.prefix_cache_save_bytes)
                if num:  # else nothing was written (a file from an earlier stop stays)
                    log.info("prefix_cache_saved", blocks=num, path=str(path))
        except Exception:
            log.exception("prefix_cache_save_failed")

    def _tick(self) -> _Tick:
        """One turn of the step thread for this engine: take in requests and aborts, run one
        step if there is work, publish the outputs."""
        engine = self._engine
        assert engine is not None  # the step thread ticks only the engines it built
        items, stop = self._drain_inbox(engine)
        if not stop and engine.has_unfinished_requests():
            try:
                items += engine.step()
                self._failures = 0
            except Exception as exc:  # a bug or device error: fail what is in flight, keep serving
                self._failures += 1
                log.exception("engine_step_failed", consecutive_failures=self._failures)
                items += self._fail_all(engine, exc)
                self._dead = self._failures >= _MAX_CONSECUTIVE_STEP_FAILURES
                if self._dead:  # for good: requests get 503 model_unavailable, /ready and /health 503
                    log.error("engine_dead", model_dir=str(self._model_dir), restart_needed=True)
        self._stats = engine.stats()
        if items and not self._publish(items):
            return _Tick.DONE
        if stop and not self._dead:  # a clean stop: every sequence was aborted, its blocks freed
            self._save_prefix_cache(engine)
        if stop or self._dead:
            return _Tick.DONE
        return _Tick.BUSY if engine.has_unfinished_requests() else _Tick.IDLE

    def _drain_inbox(self, engine: LLMEngine) -> tuple[list[RequestOutput | _Failure], bool]:
        items: list[RequestOutput | _Failure] = []
        stop = False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return items, stop
            if isinstance(msg, _Add):
                try:
                    engine.add_request(msg.request)
                except RequestRejected as exc:
                    items.append(_Failure(msg.request.request_id, exc))
                except Exception as exc:  # a request must never take the step thread (and every other) down
                    log.exception("engine_add_request_failed", request_id=msg.request.request_id)
                    engine.abort_request(msg.request.request_id)
                    error = EngineError(f"the native engine could not take the request: {type(exc).__name__}: {exc}")
                    items.append(_Failure(msg.request.request_id, error))
            elif isinstance(msg, _Abort):
                out = engine.abort_request(msg.request_id)
                if out is not None:
                    items.append(out)
            else:
                stop = True

    def _fail_all(self, engine: LLMEngine, exc: Exception) -> list[_Failure]:
        error = EngineError(f"the native engine failed a step: {type(exc).__name__}: {exc}")
        request_ids = [seq.request_id for seq in engine.scheduler.running + engine.scheduler.waiting]
        for request_id in request_ids:
            engine.abort_request(request_id)
        return [_Failure(request_id, error) for request_id in request_ids]

    def _publish(self, items: list) -> bool:
        assert self._loop is not None  # set by start(), before any step
        try:
            self._loop.call_soon_threadsafe(self._dispatch, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            log.warning("native_engine_loop_closed")
            return False
        return True


IDLE_TRIM_S = 1.0  # a step thread idle this long after working hands the C heap's free pages back
# ... and one busy without a pause does so between two steps this often: a trim takes 15-40 ms
# after ~800 MB of freed temporaries (Intel Xeon VM), once in BUSY_TRIM_S, about 0.1% of the time.
BUSY_TRIM_S = 30.0


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc keeps them otherwise; elsewhere this
    is skipped). A CPU engine's steps free large temporaries among the long-lived arrays of the
    safety classifier's cache, which runs on the same thread: glibc then keeps hundreds of MB it
    cannot return on its own (a soak on the Intel AMX VM: RssAnon +490 MB over 1,250 requests for
    +37 MB of live data; trimmed, it followed the live data)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _StepThread:
    """The thread that builds and steps every native engine of one device, one step each in
    turn, and sleeps when none has work (trimming the C heap once it has been idle IDLE_TRIM_S
    after working, or between steps after BUSY_TRIM_S of work without such a pause).
    It exits when its last engine leaves, so that its OpenMP pool goes with it. The CPU's step
    thread also runs other code's CPU work between steps (engine/torch_threads.PoolOwner: the
    safety classifier), on the same pool."""

    _registry: ClassVar[dict[str, _StepThread]] = {}
    _registry_lock = threading.Lock()

    def __init__(self, key: str):
        self.key = key
        self.wakeup = threading.Event()
        self._arrivals: list[tuple[NativeBackend, asyncio.Future]] = []
        self._members: list[NativeBackend] = []
        self.side_work = PoolOwner(self.wakeup) if key == "cpu" else None
        self.thread = threading.Thread(target=self._run, name=f"native-engine-step-{key}", daemon=True)
        self.num_trims = 0

    def _trim(self) -> float:
        trim_heap()
        self.num_trims += 1
        return time.monotonic()

    @classmethod
    def attach(cls, key: str, backend: NativeBackend, ready: asyncio.Future) -> _StepThread:
        """Hand `backend` to the step thread of `key` (started if none runs), to be built there."""
        with cls._registry_lock:
            stepper = cls._registry.get(key)
            fresh = stepper is None
            if stepper is None:
                stepper = cls._registry[key] = cls(key)
            stepper._arrivals.append((backend, ready))
            stepper.wakeup.set()
        if fresh:
            stepper.thread.start()
        return stepper

    def _run(self) -> None:
        if self.side_work is not None:
            PoolOwner.claim(self.side_work)
        worked = False  # stepped since the heap was last trimmed
        trimmed_at = time.monotonic()
        while True:
            self.wakeup.clear()
            with self._registry_lock:
                arrivals, self._arrivals = self._arrivals, []
            for backend, ready in arrivals:
                if backend._build(ready) is not None:
                    self._members.append(backend)
            busy = False
            for backend in list(self._members):
                state = backend._tick()
                if state is _Tick.DONE:
                    self._members.remove(backend)
                    backend._stopped.set()
                busy = busy or state is _Tick.BUSY
            if self.side_work is not None:
                self.side_work.run_pending()  # one turn for the side work, then the engines again
            if not self._members:
                if self.side_work is not None and not self.side_work.release():
                    continue  # work arrived meanwhile: run it before leaving
                with self._registry_lock:
                    if not self._arrivals:
                        del self._registry[self.key]
                        return
                if self.side_work is not None:
                    PoolOwner.claim(self.side_work)  # a new engine arrived: stay the owner
                continue
            worked = worked or busy
            if busy and time.monotonic() - trimmed_at >= BUSY_TRIM_S:  # no idle second to trim in
                trimmed_at = self._trim()
            elif not busy:
                if worked and not self.wakeup.wait(IDLE_TRIM_S):  # idle since: the heap's free pages go back
                    trimmed_at = self._trim()
                    worked = False
                elif not worked:
                    self.wakeup.wait()
