"""single_threaded_torch: the calling thread runs torch ops alone, the others keep their count.
PoolOwner: work handed to the thread that owns the CPU pool runs there, or elsewhere when none does."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.torch_threads import PoolOwner, PoolOwnerExecutor, _openmp, single_threaded_torch


def test_limits_only_the_calling_thread():
    before = torch.get_num_threads()
    seen = {}

    def worker():
        seen["ok"] = single_threaded_torch()
        torch.randn(1 << 20).mul(2).sum()  # parallel-sized: torch's lazy thread setup runs here
        seen["threads"] = _openmp().omp_get_max_threads()

    torch.set_num_threads(2)  # the process-wide count torch's lazy per-thread setup would apply
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert seen["ok"] and seen["threads"] == 1
    assert torch.get_num_threads() == before


class _Owner:
    """A stand-in pool owner: a thread that runs posted work until told to stop."""

    def __init__(self):
        self.wakeup = threading.Event()
        self.work = PoolOwner(self.wakeup)
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="owner")

    def _run(self):
        PoolOwner.claim(self.work)
        while True:
            self.wakeup.wait(1.0)
            self.wakeup.clear()
            self.work.run_pending()
            if self.stop and self.work.release():
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.wakeup.set()
        self.thread.join()


def test_posted_work_runs_on_the_owner_thread_in_order_and_errors_reach_the_caller():
    with _Owner():
        names = [PoolOwner.post(lambda i=i: (i, threading.current_thread().name)) for i in range(3)]
        failing = PoolOwner.post(lambda: 1 / 0)
        assert [f.result(timeout=5) for f in names if f is not None] == [(0, "owner"), (1, "owner"), (2, "owner")]
        assert failing is not None and isinstance(failing.exception(timeout=5), ZeroDivisionError)
    assert PoolOwner.post(lambda: None) is None  # released: nobody takes work any more


def test_the_executor_falls_back_when_no_owner_runs():
    with ThreadPoolExecutor(1, "fallback") as pool:
        executor = PoolOwnerExecutor(lambda: pool)
        assert executor.submit(lambda: threading.current_thread().name).result().startswith("fallback")
        with _Owner():
            assert executor.submit(lambda: threading.current_thread().name).result(timeout=5) == "owner"


def test_an_owner_with_pending_work_does_not_release():
    owner = PoolOwner(threading.Event())
    PoolOwner.claim(owner)
    future = PoolOwner.post(lambda: 7)
    assert future is not None and not owner.release()
    owner.run_pending()
    assert future.result() == 7 and owner.release()
    assert PoolOwner.post(lambda: 7) is None


def test_a_threaded_executor_runs_torch_on_its_own_thread_count_and_leaves_the_others():
    from engine.torch_threads import _openmp, side_executor, threaded_executor

    lib = _openmp()
    assert lib is not None, "torch's OpenMP runtime was not found"
    before = lib.omp_get_max_threads()

    def count() -> tuple[int, str]:
        # An elementwise op large enough to run in parallel: torch's lazy per-thread setup,
        # which once reset the worker's count to the process-wide one (1 here, as with
        # engine.num_threads = 1).
        torch.randn(1 << 20).mul(2).sum()
        return lib.omp_get_max_threads(), threading.current_thread().name

    process_wide = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert threaded_executor(3).submit(count).result() == (3, "side-torch-x3_0")
    finally:
        torch.set_num_threads(process_wide)
    assert threaded_executor(3) is threaded_executor(3)  # one worker per count, kept
    assert threaded_executor(1) is side_executor()  # one thread: the single-threaded side workers
    assert lib.omp_get_max_threads() == before
