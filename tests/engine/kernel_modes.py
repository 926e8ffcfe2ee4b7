"""Every kernel path (KernelMode) as pytest params: each compiled mode runs where the CPU has its
instruction set, and is skipped with the reason where it does not, so a test report says which ran."""

from __future__ import annotations

import pytest

from engine.native import kernels
from engine.native.kernels import KernelMode

COMPILED_MODES = [
    pytest.param(
        mode,
        id=mode.value,
        marks=pytest.mark.skipif(mode not in kernels.supported_modes(), reason=f"this CPU lacks {mode.value}"),
    )
    for mode in (KernelMode.AVX512, KernelMode.AVX2)
]
ALL_MODES = [*COMPILED_MODES, pytest.param(KernelMode.TORCH, id="torch")]


def cpu_kernels(mode: KernelMode):
    try:
        return kernels.load_kernels(mode)
    except RuntimeError as exc:  # no C compiler: the engine runs on PyTorch ops
        pytest.skip(f"the {mode.value} kernels could not be built: {exc}")
