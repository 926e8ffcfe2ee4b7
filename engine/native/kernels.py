"""The optional compiled CPU kernels (csrc/*.c): build, load, call.

- paged_attention.c: decode attention straight from the paged KV cache.
- packed_linear.c: the linear layers, from weights packed once into column panels (AVX-512).
- fused_ops.c: RMSNorm (with the residual add), SiLU * up, RoPE + the KV-cache write.
- decode_step.c: all the layers of a decode-only step in one call, from the kernels above.

Built once per machine with the system C compiler (no torch headers, about a second) into
build/native/, keyed by a hash of the sources, flags and CPU, and called through ctypes (which
releases the GIL). The library links the OpenMP runtime torch itself uses, so its parallel
regions run on the same worker threads as torch's ops (a second runtime would add a second
pool of spinning threads: see engine/torch_threads.py). Anything that goes wrong leaves the
engine on its pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from engine.torch_threads import openmp_library_path

log = structlog.get_logger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(_CSRC / name for name in ("paged_attention.c", "packed_linear.c", "fused_ops.c", "decode_step.c"))
_HEADERS = (_CSRC / "kernels.h",)
_BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "native"
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
_PANEL = 32  # output columns per packed panel (PANEL in packed_linear.c)
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {  # argument types of the C entry points (csrc/*.c); all return void
    "paged_decode_attention_f32": [_P] * 6 + [_I] * 7 + [_F],
    "pack_linear_weight_f32": [_P] * 2 + [_I] * 2,
    "packed_linear_f32": [_P] * 4 + [_I] * 3,
    "rms_norm_f32": [_P] * 4 + [_I] * 2 + [_F],
    "silu_mul_f32": [_P] * 2 + [_I] * 2,
    "rope_and_cache_f32": [_P] * 7 + [_I] * 5,
    "decode_layers_f32": [_P] * 7 + [_I] * 3 + [_P] + [_I] * 7 + [_F] * 2 + [_P],
}
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0] if flags else platform.processor()
    except OSError:
        return platform.processor()


def _link_openmp() -> list[str]:
    """Link torch's own OpenMP runtime where it ships one, else the compiler's."""
    torch_openmp = openmp_library_path()
    if torch_openmp is None:
        return ["-fopenmp"]
    return [str(torch_openmp), f"-Wl,-rpath,{torch_openmp.parent}"]


def library_path() -> Path:
    digest = hashlib.sha256(" ".join([*_FLAGS, *_link_openmp(), _cpu_signature()]).encode())
    for source in (*_SOURCES, *_HEADERS):
        digest.update(source.read_bytes())
    return _BUILD_DIR / f"native-kernels-{platform.machine()}-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernels if this machine has no up-to-date build; returns the library path."""
    target = library_path()
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a scratch directory and rename: concurrent builders never see a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [str(Path(scratch) / f"{source.stem}.o") for source in _SOURCES]
        library = Path(scratch) / "kernels.so"
        try:
            for source, obj in zip(_SOURCES, objects, strict=True):
                subprocess.run([compiler, *_FLAGS, "-c", "-o", obj, str(source)], check=True, capture_output=True)
            link = [compiler, "-shared", "-o", str(library), *objects, *_link_openmp(), "-lm"]
            subprocess.run(link, check=True, capture_output=True)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"building the native kernels failed: {exc.stderr.decode(errors='replace')[-2000:]}") from None
        os.replace(library, target)
    return target


def load() -> bool:
    """Build (if needed) and load the kernels once; False if they are unavailable here."""
    global _lib, _tried
    if _tried:
        return _lib is not None
    _tried = True
    try:
        lib = ctypes.CDLL(str(build()))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = None, argtypes
        lib.packed_linear_available.restype, lib.packed_linear_available.argtypes = ctypes.c_int, []
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


def packed_linear_available() -> bool:
    """Whether the loaded kernels include the packed linear layers (AVX-512 CPUs)."""
    return load() and bool(_lib.packed_linear_available())


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """A linear layer's weight [out_features, in_features], packed for packed_linear()."""

    panels: torch.Tensor  # [ceil(out_features / 32), in_features, 32] fp32
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)


def pack_linear(weight: torch.Tensor) -> PackedLinear:
    """Pack an fp32 CPU weight [out_features, in_features] once, at load time."""
    if not packed_linear_available():
        raise RuntimeError("the packed linear kernel is not available on this machine")
    weight = weight.detach().to(torch.float32).contiguous()
    n, k = weight.shape
    panels = torch.empty((-(-n // _PANEL), k, _PANEL), dtype=torch.float32)
    _lib.pack_linear_weight_f32(weight.data_ptr(), panels.data_ptr(), n, k)
    return PackedLinear(panels, n, k)


def packed_linear(x: torch.Tensor, weight: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for x [rows, in_features] fp32 on the CPU and W packed by pack_linear."""
    x = x.contiguous()
    rows, k = x.shape
    if k != weight.in_features:
        raise ValueError(f"input has {k} features, the layer takes {weight.in_features}")
    out = torch.empty((rows, weight.out_features), dtype=torch.float32)
    if rows:
        bias_ptr = None if bias is None else bias.contiguous().data_ptr()
        _lib.packed_linear_f32(x.data_ptr(), weight.panels.data_ptr(), bias_ptr, out.data_ptr(), rows, weight.out_features, k)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """F.rms_norm over the last dim of x [rows, dim]. With residual, x += residual first, in place."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    out = torch.empty_like(x)
    rows, dim = x.shape
    res_ptr = None if residual is None else residual.data_ptr()
    _lib.rms_norm_f32(x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), rows, dim, eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * dim] -> silu(gate) * up [rows, dim]."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    _lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def rope_and_cache(
    qkv: torch.Tensor,  # [tokens, (heads + 2 * kv_heads) * head_dim], rotated in place
    positions: torch.Tensor,  # [tokens] int64
    cos: torch.Tensor,  # [max_positions, head_dim]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, kv_heads, head_dim, block_size]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [tokens] int64
    num_heads: int,
) -> None:
    """RoPE on q and k in place, then the new k and v written into the paged cache."""
    assert qkv.is_contiguous() and positions.dtype == slot_mapping.dtype == torch.int64
    _, kv_heads, head_dim, block_size = k_cache.shape
    _lib.rope_and_cache_f32(
        qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), qkv.shape[0], num_heads, kv_heads, head_dim, block_size,
    )


class DecodeStack:
    """Runs every layer of a decode-only step in one call (csrc/decode_step.c).

    Holds the per-layer addresses of the packed weights and the KV cache, so it must live no
    longer than the weights and the cache it was built from (the model keeps it beside them).
    """

    def __init__(self, layers, kv_caches, *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float):
        rows = []
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            bias = layer.qkv_bias.data_ptr() if layer.qkv_bias is not None else 0
            rows.append([
                layer.input_norm.data_ptr(), layer.qkv.panels.data_ptr(), bias, layer.o_proj.panels.data_ptr(),
                layer.post_norm.data_ptr(), layer.gate_up.panels.data_ptr(), layer.down.panels.data_ptr(),
                k_cache.data_ptr(), v_cache.data_ptr(),
            ])
        self._keep = (layers, kv_caches)
        self.kv_cache_ptr = kv_caches[0][0].data_ptr()
        self._table = torch.tensor(rows, dtype=torch.int64)
        self._dims = (len(rows), hidden, heads, kv_heads, head_dim, intermediate, kv_caches[0][0].shape[-1])
        self._eps, self._scale = eps, head_dim**-0.5
        self._scratch_per_token = 3 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim + 3 * intermediate

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int) -> torch.Tensor:
        """x [tokens, hidden] (the embeddings) becomes the residual stream after the last layer, in place."""
        assert x.is_contiguous() and block_tables.is_contiguous() and block_tables.dtype == context_lens.dtype == torch.int32
        tokens = x.shape[0]
        scratch = torch.empty(tokens * self._scratch_per_token, dtype=torch.float32)
        _lib.decode_layers_f32(
            x.data_ptr(), positions.data_ptr(), slots.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            block_tables.data_ptr(), context_lens.data_ptr(), block_tables.shape[1], max_context_len, tokens,
            self._table.data_ptr(), *self._dims, self._eps, self._scale, scratch.data_ptr(),
        )
        return x
