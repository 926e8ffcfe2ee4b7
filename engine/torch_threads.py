"""Per-thread limits on torch's CPU threads.

torch's CPU ops run on GNU OpenMP, and every thread that runs a multi-threaded op keeps its own
pool of OpenMP worker threads while it lives. Once a process holds more pool threads than
cores, libgomp stops spinning between parallel regions and hands work over through the kernel,
which costs about 80 us per op (measured on the 2-core development machine): a small decode
step has hundreds of ops. The native engines therefore share one step thread per device
(engine/native/backend.py), and other code that runs torch on the side (the safety
classifier) limits its own threads to one with `single_threaded_torch()`, which creates no
pool at all. `torch.set_num_threads` would not do: it also changes the process-wide default.
Better still, such code hands its work to the step thread itself (`PoolOwner`), which runs it
between steps on its own pool: all the cores, one turn at a time.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


def openmp_library_path() -> Path | None:
    """The GNU OpenMP runtime bundled with torch (torch/lib/libgomp-*.so*), or None."""
    import torch

    bundled = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return Path(bundled[0]) if bundled else None


@cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch uses (its bundled libgomp, else the system's), or None."""
    bundled = openmp_library_path()
    for path in (*([str(bundled)] if bundled else []), "libgomp.so.1"):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def single_threaded_torch() -> bool:
    """Make torch ops called from the current thread run on this thread alone (no OpenMP pool).

    Affects only the calling thread. Returns False where torch has no OpenMP runtime to tell.
    """
    lib = _openmp()
    if lib is None:
        log.debug("openmp_runtime_not_found")
        return False
    _init_torch_threads()
    lib.omp_set_num_threads(1)
    return True


def _init_torch_threads() -> None:
    """Run torch's once-per-thread thread setup now: torch does it lazily at a thread's first
    parallel op and sets the thread's OpenMP count to its process-wide one (engine.num_threads
    or the cores), which would undo a count set on the thread before it."""
    import torch

    torch.get_num_threads()


class PoolOwner:
    """Work that other code hands to the thread that owns the process's CPU OpenMP pool (the
    native engines' CPU step thread, engine/native/backend.py), run there between its own
    steps. Such work gets every core without a second pool, and it takes turns with the engine
    instead of competing with it: on a machine with as many pool threads as cores, a third
    runnable thread (a side worker) stalls every parallel region of the engine's step for as
    long as it shares a core with one of the pool's threads.

    The owner registers itself with `claim`, calls `run_pending` between steps, and `release`s
    before it exits; `post` sets its wake-up event so that an idle owner runs the work at once.
    """

    _lock = threading.Lock()
    _current: PoolOwner | None = None

    def __init__(self, wakeup: threading.Event):
        self._wakeup = wakeup
        self._pending: list[tuple[Future, Callable[[], object]]] = []

    @classmethod
    def claim(cls, owner: PoolOwner) -> None:
        with cls._lock:
            cls._current = owner

    def release(self) -> bool:
        """Stop taking work; False (still the owner) while work is pending: run it, then retry."""
        with PoolOwner._lock:
            if self._pending:
                return False
            if PoolOwner._current is self:
                PoolOwner._current = None
            return True

    @classmethod
    def post(cls, fn: Callable[[], object]) -> Future | None:
        """Queue `fn` on the current owner; None when no owner runs (the caller runs it elsewhere)."""
        with cls._lock:
            owner = cls._current
            if owner is None:
                return None
            future: Future = Future()
            owner._pending.append((future, fn))
        owner._wakeup.set()
        return future

    def has_pending(self) -> bool:
        return bool(self._pending)

    def run_pending(self) -> None:
        """Run the work queued so far, in order (blocking; on the owner's thread)."""
        with PoolOwner._lock:
            pending, self._pending = self._pending, []
        for future, fn in pending:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller, as an executor would
                future.set_exception(exc)
            else:
                future.set_result(result)


class PoolOwnerExecutor(Executor):
    """An Executor that runs each call on the CPU pool's owner when one runs (PoolOwner), else
    on `fallback()` (for example a single-threaded worker, when no native CPU engine runs)."""

    def __init__(self, fallback: Callable[[], Executor]):
        self._fallback = fallback

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = PoolOwner.post(functools.partial(fn, *args, **kwargs))
        return future if future is not None else self._fallback().submit(fn, *args, **kwargs)


# Side work (the safety classifier, the embeddings endpoint) runs on the CPU pool's owner when a
# native CPU engine runs; without one (another backend, tests) and for loading, on these
# threads, each limited to one OpenMP thread: a second multi-threaded torch thread would give
# the process a second OpenMP pool (see above). Two of them let two texts be encoded at once.
_SIDE_WORKERS = 2
_side_executor: ThreadPoolExecutor | None = None
_side_executor_lock = threading.Lock()


def side_executor() -> ThreadPoolExecutor:
    """The single-threaded torch workers shared by side work (created on first use)."""
    global _side_executor
    with _side_executor_lock:
        if _side_executor is None:
            _side_executor = ThreadPoolExecutor(_SIDE_WORKERS, "side-torch", initializer=single_threaded_torch)
        return _side_executor


def pool_or_side_executor() -> Executor:
    """The CPU pool's owner when a native CPU engine runs, else the single-threaded workers."""
    return PoolOwnerExecutor(side_executor)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _openmp_threads(num_threads: int) -> None:
    """Worker initializer: torch ops called from this thread use `num_threads` OpenMP threads."""
    lib = _openmp()
    if lib is not None:
        _init_torch_threads()
        lib.omp_set_num_threads(num_threads)


_threaded_executors: dict[int, ThreadPoolExecutor] = {}


def threaded_executor(num_threads: int) -> ThreadPoolExecutor:
    """One worker whose torch ops use `num_threads` OpenMP threads (its own pool), for side work
    in a process where no native CPU engine owns the pool (the engine on a GPU, other backends):
    there the single-threaded side workers would leave the other cores idle. Never use it beside a
    native CPU engine: a second pool would slow every step of the engine (see above)."""
    if num_threads <= 1:
        return side_executor()
    with _side_executor_lock:
        executor = _threaded_executors.get(num_threads)
        if executor is None:
            executor = ThreadPoolExecutor(
                1, f"side-torch-x{num_threads}", initializer=_openmp_threads, initargs=(num_threads,)
            )
            _threaded_executors[num_threads] = executor
        return executor
