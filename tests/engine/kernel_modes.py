"""Every kernel path (KernelMode) as pytest params: each compiled mode runs where the CPU has its
instruction set, and is skipped with the reason where it does not, so a test report says which ran."""

from __future__ import annotations

import pytest

from engine.native import kernels
from engine.native.kernels import KernelMode
from native_harness import TEST_DEVICE


def _compiled(mode: KernelMode, *, whole_engine: bool):
    marks = [pytest.mark.skipif(mode not in kernels.supported_modes(), reason=f"this CPU lacks {mode.value}")]
    if whole_engine:  # on CUDA (ENGINE_TEST_DEVICE) the engine has only the PyTorch-ops path
        marks.append(pytest.mark.skipif(TEST_DEVICE != "cpu", reason=f"the engine runs on {TEST_DEVICE}"))
    return pytest.param(mode, id=mode.value, marks=marks)


COMPILED = (KernelMode.AVX512, KernelMode.AVX2)
COMPILED_MODES = [_compiled(mode, whole_engine=False) for mode in COMPILED]
# For tests that run the whole engine, on TEST_DEVICE.
ALL_MODES = [
    *(_compiled(mode, whole_engine=True) for mode in COMPILED),
    pytest.param(KernelMode.TORCH, id="torch" if TEST_DEVICE == "cpu" else f"torch-{TEST_DEVICE}"),
]


def cpu_kernels(mode: KernelMode):
    try:
        return kernels.load_kernels(mode)
    except RuntimeError as exc:  # no C compiler: the engine runs on PyTorch ops
        pytest.skip(f"the {mode.value} kernels could not be built: {exc}")
