"""The compiled CPU kernels (csrc/*.c): which instruction set, build, load, call.

- paged_attention.c: decode attention straight from the paged KV cache.
- packed_linear.c: the linear layers, from weights packed once into column panels (fp32, int8 or int4).
- fused_ops.c: RMSNorm (with the residual add), SiLU * up, GELU-tanh * up, RoPE + the KV-cache write.
- decode_step.c: all the layers of a decode-only step in one call, from the kernels above.
- int8_gemm.c: int8 x int8 -> int32 matmuls from weights packed once (VNNI where the CPU has it).
- int8_glue.c: the float work between int8 matmuls (quantize rows; int32 sums to floats with
  GELU, or with the residual add and LayerNorm), for the safety encoder's w8a8 layers.
- gated_delta.c: a decode step of Qwen3.5's Gated DeltaNet state, in place in the state pool.

The same sources are built once per KernelMode (AVX-512 or AVX2 + FMA, each with its own -m
flags, simd.h picks the vector width), so one machine can run, and CI can test, every path its
CPU supports. `resolve_mode` is the one place that decides which a runner uses. Each library is
built with the system C compiler (no torch headers, about a second) into build/native/, keyed by
a hash of the sources and flags, and called through ctypes (which releases the GIL). It links
the OpenMP runtime torch itself uses, so its parallel regions run on torch's worker threads (see
engine/torch_threads.py).

NATIVE_KERNELS_SANITIZE=1 in the environment builds (into their own files) and loads the kernels
with AddressSanitizer and UndefinedBehaviorSanitizer: tests/engine/test_sanitizers.py runs the
kernel tests that way in a child process, with the sanitizer runtime preloaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from enum import Enum
from functools import cache
from pathlib import Path

import structlog
import torch

from engine.native.cpu_ops import CpuKernels
from engine.torch_threads import openmp_library_path
from engine.types import EngineError

log = structlog.get_logger(__name__)


class KernelMode(Enum):
    """Which code runs a CPU step: the C kernels built for one instruction set, or PyTorch ops."""

    AVX512 = "avx512"
    AVX2 = "avx2"
    TORCH = "torch"


# What each compiled mode needs from the CPU (/proc/cpuinfo flags) and tells the compiler.
_REQUIRED_FLAGS = {
    KernelMode.AVX512: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}),
    KernelMode.AVX2: frozenset({"avx2", "fma"}),
}
_ISA_FLAGS = {
    KernelMode.AVX512: ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"),
    KernelMode.AVX2: ("-mavx2", "-mfma"),
}
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(
    _CSRC / name
    for name in (
        "paged_attention.c",
        "packed_linear.c",
        "fused_ops.c",
        "decode_step.c",
        "int8_glue.c",
        "int8_gemm.c",
        "gated_delta.c",
    )
)
_HEADERS = (_CSRC / "kernels.h", _CSRC / "simd.h")
_BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "native"
# -Bsymbolic: calls between the kernels bind inside their own library, so two modes' libraries
# (same symbol names) can be loaded side by side.
_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")
# Sanitized builds: every report aborts (a test fails), with stack traces that name the line.
_SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1")
SANITIZE_ENV = "NATIVE_KERNELS_SANITIZE"
_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# name -> (return type, argument types) of every function csrc/kernels.h declares, in its order
# (tests/engine/test_kernel_header.py checks the two agree). Pointers are passed as addresses.
SIGNATURES: dict[str, tuple[type | None, Sequence[type]]] = {
    "paged_decode_attention_f32": (_INT, [_P] * 6 + [_I] * 7 + [_F, _I, _F]),
    "packed_linear_panel": (_I, []),
    "packed_linear_use_vnni": (None, [_I]),
    "packed_linear": (_INT, [_P] * 5 + [_I] * 4),
    "rms_norm_f32": (None, [_P] * 4 + [_I] * 2 + [_F]),
    "silu_mul_f32": (None, [_P] * 2 + [_I] * 2),
    "gelu_tanh_mul_f32": (None, [_P] * 2 + [_I] * 2),
    "rope_and_cache_f32": (None, [_P] * 7 + [_I] * 6),
    "decode_layers_f32": (_INT, [_P] * 5 + [_I] * 3 + [_P] + [_I] * 8 + [_F] * 3 + [_P]),
    "quantize_rows_i8": (None, [_P] * 3 + [_I] * 2),
    "dequant_i32_f32": (None, [_P] * 7 + [_I] * 3),
    "dequant_add_layer_norm_f32": (None, [_P] * 10 + [_I] * 2 + [_F]),
    "window_attention_f32": (_INT, [_P] * 4 + [_I] * 3 + [_F]),
    "int8_gemm_block": (_I, []),
    "int8_gemm_pack": (_INT, [_P] * 3 + [_I] * 2),
    "int8_gemm": (None, [_P] * 4 + [_I] * 4),
    "gated_delta_decode_f32": (None, [_P] * 8 + [_I] * 4),
}


def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_modes() -> tuple[KernelMode, ...]:
    """The compiled modes this CPU can run, fastest first (TORCH is always possible)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ()
    flags = cpu_flags()
    return tuple(mode for mode, needed in _REQUIRED_FLAGS.items() if needed <= flags)


def resolve_mode(*, enabled: bool, isa: str, device: torch.device, dtype: torch.dtype) -> KernelMode:
    """The one decision: which kernels a runner uses, from the settings and what the CPU reports.

    isa: "auto" (the fastest this CPU supports) or a KernelMode value to force a lower one
    (tests, benchmarks); forcing one the CPU lacks is an error. A build failure (no compiler)
    falls back to TORCH with a warning.
    """
    if isa != "auto" and isa not in {m.value for m in KernelMode}:
        raise EngineError(f"engine.kernel_isa {isa!r} is not one of auto, {', '.join(m.value for m in KernelMode)}")
    if not enabled or device.type != "cpu" or dtype != torch.float32 or isa == KernelMode.TORCH.value:
        return KernelMode.TORCH
    available = supported_modes()
    if isa != "auto" and KernelMode(isa) not in available:
        raise EngineError(
            f"engine.kernel_isa is {isa!r} but this CPU supports only {[m.value for m in available] or 'none'}"
        )
    for mode in [KernelMode(isa)] if isa != "auto" else available:
        try:
            load_kernels(mode)
            return mode
        except RuntimeError as exc:
            log.warning("native_kernel_unavailable", mode=mode.value, reason=str(exc))
    return KernelMode.TORCH


AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
AMX_PREFILL_SETTINGS = ("auto", "on", "off")


def resolve_amx_prefill(
    setting: str,
    *,
    mode: KernelMode,
    is_quantized: bool,
    checkpoint_dtype: torch.dtype | None,
    flags: frozenset[str] | None = None,
) -> bool:
    """Whether the runner's prefill steps use AMX (engine.amx_prefill; model.linear's AMX path).

    "auto": where the CPU has AMX, the avx512 kernels run, the weights are not quantized and the
    checkpoint is stored in bfloat16 (so the bf16 copy of each weight is exact). "on": the same
    but for any checkpoint dtype; an error naming what is missing. `flags`: the CPU's unless given.
    """
    if setting not in AMX_PREFILL_SETTINGS:
        raise EngineError(f"engine.amx_prefill {setting!r} is not one of {', '.join(AMX_PREFILL_SETTINGS)}")
    if setting == "off":
        return False
    flags = cpu_flags() if flags is None else flags
    missing = []
    if not AMX_FLAGS.issubset(flags) or not torch.backends.mkldnn.is_available():
        missing.append("a CPU with AMX (amx_tile, amx_bf16) and PyTorch's oneDNN")
    if mode is not KernelMode.AVX512:
        missing.append(f"the avx512 kernels (this engine runs {mode.value})")
    if is_quantized:
        missing.append("unquantized weights (engine.quantization = none)")
    if setting == "on" and missing:
        raise EngineError(f"engine.amx_prefill = on needs {' and '.join(missing)}; set it to auto or off")
    return not missing and (setting == "on" or checkpoint_dtype == torch.bfloat16)


def _link_openmp() -> list[str]:
    """Link torch's own OpenMP runtime where it ships one, else the compiler's."""
    torch_openmp = openmp_library_path()
    if torch_openmp is None:
        return ["-fopenmp"]
    return [str(torch_openmp), f"-Wl,-rpath,{torch_openmp.parent}"]


def is_sanitized() -> bool:
    return os.environ.get(SANITIZE_ENV, "") not in ("", "0")


def _compile_flags(mode: KernelMode) -> list[str]:
    return [*_FLAGS, *_ISA_FLAGS[mode], *(_SANITIZE_FLAGS if is_sanitized() else ())]


def library_path(mode: KernelMode) -> Path:
    digest = hashlib.sha256(" ".join([*_compile_flags(mode), *_link_openmp()]).encode())
    for source in (*_SOURCES, *_HEADERS):
        digest.update(source.read_bytes())
    kind = "-asan" if is_sanitized() else ""
    return _BUILD_DIR / f"native-kernels-{mode.value}{kind}-{digest.hexdigest()[:16]}.so"


def build(mode: KernelMode) -> Path:
    """Compile the kernels for one mode unless an up-to-date build exists; returns the library path."""
    target = library_path(mode)
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = _compile_flags(mode)
    # Build in a scratch directory and rename: concurrent builders never see a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [str(Path(scratch) / f"{source.stem}.o") for source in _SOURCES]
        library = Path(scratch) / "kernels.so"
        try:
            for source, obj in zip(_SOURCES, objects, strict=True):
                subprocess.run([compiler, *flags, "-c", "-o", obj, str(source)], check=True, capture_output=True)
            sanitizers = [_SANITIZE_FLAGS[0]] if is_sanitized() else []  # links the sanitizer runtimes
            link = [
                compiler,
                "-shared",
                *sanitizers,
                "-Wl,-Bsymbolic",
                "-o",
                str(library),
                *objects,
                *_link_openmp(),
                "-lm",
            ]
            subprocess.run(link, check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = (
                exc.stderr.decode(errors="replace")[-2000:] if isinstance(exc, subprocess.CalledProcessError) else exc
            )
            raise RuntimeError(f"building the {mode.value} kernels failed: {detail}") from None
        os.replace(library, target)
    return target


@cache
def load_kernels(mode: KernelMode) -> CpuKernels:
    """Build (if needed) and load one mode's library, once per process; RuntimeError if it cannot."""
    if mode is KernelMode.TORCH:
        raise ValueError("KernelMode.TORCH has no compiled kernels")
    try:
        lib = ctypes.CDLL(str(build(mode)))
    except OSError as exc:
        raise RuntimeError(f"loading the {mode.value} kernels failed: {exc}") from None
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    log.info("native_kernel_loaded", mode=mode.value, path=str(library_path(mode)))
    return CpuKernels(mode, lib)
