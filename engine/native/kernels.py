"""The optional compiled CPU kernel (csrc/paged_attention.c): build, load, call.

Built once per machine with the system C compiler (no torch headers, about a second) into
build/native/, keyed by a hash of the source, flags and CPU, and called through ctypes (which
releases the GIL). Anything that goes wrong leaves the engine on its pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
_BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "native"
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0] if flags else platform.processor()
    except OSError:
        return platform.processor()


def library_path() -> Path:
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_signature().encode()).hexdigest()
    return _BUILD_DIR / f"paged_attention-{platform.machine()}-{key[:16]}.so"


def build() -> Path:
    """Compile the kernel if this machine has no up-to-date build; returns the library path."""
    target = library_path()
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never see a half-written file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", str(tmp_path), str(_SOURCE), "-lm"], check=True, capture_output=True)
        os.replace(tmp_path, target)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"compiling {_SOURCE.name} failed: {exc.stderr.decode(errors='replace')[-2000:]}") from None
    finally:
        tmp_path.unlink(missing_ok=True)
    return target


def load() -> bool:
    """Build (if needed) and load the kernel once; False if it is unavailable here."""
    global _lib, _tried
    if _tried:
        return _lib is not None
    _tried = True
    try:
        lib = ctypes.CDLL(str(build()))
        fn = lib.paged_decode_attention_f32
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float]
        _lib = lib
        log.info("native_kernel_loaded", path=str(library_path()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native_kernel_unavailable", reason=str(exc))
    return _lib is not None


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    block_size: int,
    max_context_len: int,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    _lib.paged_decode_attention_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        k_cache.shape[1],
        head_dim,
        block_tables.shape[1],
        block_size,
        max_context_len,
        head_dim**-0.5,
    )
    return out
