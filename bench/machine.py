"""The machine under the benches: its CPU, threads, device and dtype, its measured matmul peak,
a device sync for timers, and running torch work off the main thread. Holds no workload and
prints nothing.
"""

from __future__ import annotations

import platform
import threading
import time
from pathlib import Path

import torch


def in_own_thread(fn, *args):
    """Run torch work in a thread that then exits. A thread that ran multi-threaded torch ops
    keeps an OpenMP pool while it lives, and two live pools on a small machine slow every op of
    the engine's step thread (see NativeBackend.start), so the main thread stays torch-free."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    thread.join()
    if not result:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed; see the traceback above")
    return result[0]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a timer reads its end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak_gflops(
    n: int = 2048, repeats: int = 5, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> float:
    """The best square matmul rate in this dtype on this device (8192 on a GPU, where 2048 is too small to fill it)."""
    device = device or torch.device("cpu")
    n = 8192 if device.type == "cuda" else n
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def machine_info(peak: float, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "peak_gflops": peak}
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return {**info, "device": str(device or "cpu"), "dtype": str(dtype).removeprefix("torch.")}
