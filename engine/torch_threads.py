"""Per-thread limits on torch's CPU threads.

torch's CPU ops run on GNU OpenMP, and every thread that runs a multi-threaded op keeps its own
pool of OpenMP worker threads while it lives. Once a process holds more pool threads than
cores, libgomp stops spinning between parallel regions and hands work over through the kernel,
which costs about 80 us per op (measured on the 2-core development machine): a small decode
step has hundreds of ops. The native engines therefore share one step thread per device
(engine/native/backend.py), and other code that runs torch on the side (the safety
classifier) limits its own threads to one with `single_threaded_torch()`, which creates no
pool at all. `torch.set_num_threads` would not do: it also changes the process-wide default.
"""

from __future__ import annotations

import ctypes
import glob
import os
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
    lib.omp_set_num_threads(1)
    return True
