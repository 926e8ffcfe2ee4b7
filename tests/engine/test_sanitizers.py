"""The C kernels under AddressSanitizer + UndefinedBehaviorSanitizer: their tests run once in a
child process that builds and loads the sanitized library (kernels.SANITIZE_ENV) with the ASan
runtime preloaded (Python itself is not instrumented). Any report aborts the child."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.native import kernels

ROOT = Path(__file__).resolve().parents[2]
# The kernel tests, and the engine tests whose decode steps run the one-call layer stack
# (decode_layers_f32) on every compiled mode: Llama's layer (int8, int4), and the families whose
# layers use the stack's other fields (hybrid windows and per-layer RoPE, soft-caps, post norms,
# partial RoPE).
_FAMILY_TEST = "tests/engine/test_families.py::test_family_matches_transformers_greedy_token_for_token"
KERNEL_TESTS = [
    "tests/engine/test_cpu_kernels.py",
    "tests/engine/test_attention.py",
    "tests/engine/test_kernel_header.py",
    "tests/engine/test_int8.py::test_quantized_engine_matches_transformers_on_the_rounded_weights_token_for_token",
    *(
        f"{_FAMILY_TEST}[{family}-{mode}]"
        for family in ("gemma3", "gemma2", "olmo2", "phi3")
        for mode in ("avx512", "avx2")
    ),
]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="module")
def sanitizer_env(tmp_path_factory) -> dict[str, str]:
    """The child's environment; skips when this compiler cannot build with the sanitizers."""
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C compiler (cc/gcc): the kernels are not built at all")
    if not kernels.supported_modes():
        pytest.skip("this CPU runs no compiled kernel mode")
    probe = tmp_path_factory.mktemp("asan") / "probe.c"
    probe.write_text("int probe(int *p) { return p[1] << 1; }\n")
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-fsanitize=address,undefined", "-o", str(probe.with_suffix(".so")), str(probe)],
        capture_output=True,
        text=True,
    )
    runtime = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if built.returncode != 0 or not os.path.isabs(runtime) or not os.path.exists(runtime):
        pytest.skip(f"{compiler} cannot build with -fsanitize=address,undefined: {built.stderr[-300:] or runtime}")
    return {
        **os.environ,
        kernels.SANITIZE_ENV: "1",
        "LD_PRELOAD": runtime,
        # Python and torch are not instrumented and keep their allocations for the process's life.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_the_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers(sanitizer_env):
    child = _run(sanitizer_env, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS)
    report = child.stdout[-6000:] + child.stderr[-6000:]
    assert child.returncode == 0, report
    assert "passed" in child.stdout and "Sanitizer" not in report, report
    assert any(kernels._BUILD_DIR.glob("native-kernels-*-asan-*.so")), "the child did not build the sanitized kernels"


@pytest.mark.slow
def test_the_sanitized_kernels_report_an_out_of_bounds_read(sanitizer_env):
    # silu_mul_f32 told the buffer holds 2 rows when it holds 1: the second row's read overflows.
    script = textwrap.dedent(
        """
        import torch
        from engine.native import kernels
        cpu = kernels.load_kernels(kernels.supported_modes()[0])
        gate_up, out = torch.randn(1, 64), torch.empty(2, 32)
        cpu._lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), 2, 32)
        """
    )
    child = _run(sanitizer_env, "-c", script)
    assert child.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in child.stderr, child.stderr[-3000:]
    assert "silu_mul_f32" in child.stderr
