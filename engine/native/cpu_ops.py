"""The Python side of one loaded kernel library (kernels.load_kernels): pack weights, call kernels.

A CpuKernels object belongs to one KernelMode; the runner holds it and hands it to the model,
so nothing here is module state. Every call takes contiguous fp32 CPU tensors (the runner only
builds a CpuKernels for fp32 on the CPU).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.native.quant import GROUP_SIZE, Quantization, quantize

if TYPE_CHECKING:
    from engine.native.attention import AttentionMetadata
    from engine.native.kernels import KernelMode


@dataclass(frozen=True, slots=True)
class PackedInt8:
    """An int8 weight [in_features, out_features] (torch._int_mm's layout, values in -63..63),
    packed once for CpuKernels.int8_gemm."""

    blocks: torch.Tensor  # int8 [out_features / block, in_features / 4, block, 4]
    colsum128: torch.Tensor  # int32 [out_features]: 128 * each column's sum
    in_features: int
    out_features: int
    kernels: CpuKernels


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """A linear layer's weight [out_features, in_features], packed for CpuKernels.packed_linear.
    The layout depends on the instruction set, so it keeps the kernels that packed it."""

    panels: torch.Tensor  # [ceil(out_features / panel), in_features, panel] fp32 or int8;
    # int4: uint8 [.., in_features padded to 32 / 8, panel, 4] (_int4_panels)
    scales: torch.Tensor | None  # quantized: [ceil(out_features / panel), ceil(in_features / 32), panel] fp32
    out_features: int
    in_features: int
    kernels: CpuKernels
    bits: int = 32  # 32: fp32 panels; 8: int8; 4: int4
    amx: torch.Tensor | None = None  # engine.amx_prefill: the weight in bf16 [out, in], for steps of many rows

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        extra = (0 if self.scales is None else self.scales.nbytes) + (0 if self.amx is None else self.amx.nbytes)
        return self.panels.nbytes + extra


def _to_panels(matrix: torch.Tensor, panel: int) -> torch.Tensor:
    """[rows, cols] -> [ceil(rows / panel), cols, panel], zero-padded past the last row."""
    rows, cols = matrix.shape
    num_panels = -(-rows // panel)
    padded = torch.zeros((num_panels * panel, cols), dtype=matrix.dtype)
    padded[:rows] = matrix
    return padded.view(num_panels, panel, cols).transpose(1, 2).contiguous()


def _int4_panels(q: torch.Tensor, panel: int) -> torch.Tensor:
    """int4 values [rows, cols] (-8..7) -> uint8 [ceil(rows / panel), cols_pad / 8, panel, 4], cols
    padded to a multiple of GROUP_SIZE with zeros: in each block of 8 columns, byte i of a row's 4
    holds column 8b + i in the low nibble and 8b + 4 + i in the high one, each as q + 8
    (csrc/packed_linear.c, the w4a8 layout)."""
    rows, cols = q.shape
    cols_pad = -(-cols // GROUP_SIZE) * GROUP_SIZE
    nibbles = torch.full((rows, cols_pad), 8, dtype=torch.uint8)
    nibbles[:, :cols] = (q.to(torch.int16) + 8).to(torch.uint8)
    blocks = nibbles.view(rows, cols_pad // 8, 2, 4)  # [rows, block, low/high half, i]
    packed = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # [rows, block, 4]
    num_panels = -(-rows // panel)
    padded = torch.full((num_panels * panel, cols_pad // 8, 4), 0x88, dtype=torch.uint8)
    padded[:rows] = packed
    return padded.view(num_panels, panel, cols_pad // 8, 4).transpose(1, 2).contiguous()


class CpuKernels:
    def __init__(self, mode: KernelMode, lib: ctypes.CDLL):
        self.mode = mode
        self._lib = lib
        self.panel = int(lib.packed_linear_panel())  # output columns per packed panel
        self.vector_floats = 16 if mode.value == "avx512" else 8  # floats in one of its vector registers
        self.has_vnni = False  # int8 dot products in one instruction at this vector width (use_vnni)
        self.use_vnni(_has_vnni(mode.value))

    def use_vnni(self, on: bool) -> None:
        """Whether the int8 dot products (int8_gemm, int4 packed_linear) use VNNI: what the CPU
        has, at load; tests turn it off to run the other instruction sequence too."""
        self.has_vnni = on
        self._lib.packed_linear_use_vnni(int(on))

    def pack_linear(self, weight: torch.Tensor, quantization: Quantization = Quantization.NONE) -> PackedLinear:
        """Pack an fp32 CPU weight [out_features, in_features] once, at load time (int8, int4:
        quantized too)."""
        weight = weight.detach().to(torch.float32)
        n, k = weight.shape
        if quantization is Quantization.NONE:
            return PackedLinear(_to_panels(weight, self.panel), None, n, k, self)
        quantized = quantize(weight, quantization)
        scales = _to_panels(quantized.scales, self.panel)
        if quantization is Quantization.INT4:
            return PackedLinear(_int4_panels(quantized.q, self.panel), scales, n, k, self, quantization.bits)
        return PackedLinear(_to_panels(quantized.q, self.panel), scales, n, k, self, quantization.bits)

    def packed_linear(self, x: torch.Tensor, weight: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, W, bias) for x [rows, in_features] and W packed by pack_linear."""
        x = x.contiguous()
        rows, k = x.shape
        if k != weight.in_features:
            raise ValueError(f"input has {k} features, the layer takes {weight.in_features}")
        if weight.kernels is not self:
            raise ValueError(f"the weight was packed for {weight.kernels.mode.value}, not {self.mode.value}")
        out = torch.empty((rows, weight.out_features), dtype=torch.float32)
        if rows:
            scales = None if weight.scales is None else weight.scales.data_ptr()
            bias_ptr = None if bias is None else bias.contiguous().data_ptr()
            status = self._lib.packed_linear(
                x.data_ptr(), weight.panels.data_ptr(), scales, bias_ptr, out.data_ptr(), rows, weight.out_features, k,
                weight.bits,
            )  # fmt: skip
            if status != 0:
                raise MemoryError("packed_linear could not allocate its scratch memory")
        return out

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        context_lens: torch.Tensor,  # [num_seqs] int32
        max_context_len: int,
        *,
        scale: float | None = None,  # multiplies q.k; None: head_dim ** -0.5
        sliding_window: int | None = None,  # attend to the last `sliding_window` positions only
        softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    ) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
        q = q.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_heads, head_dim = q.shape
        status = self._lib.paged_decode_attention_f32(
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
            k_cache.shape[3],
            max_context_len,
            head_dim**-0.5 if scale is None else scale,
            sliding_window or 0,
            softcap or 0.0,
        )
        if status != 0:
            raise MemoryError("decode attention could not allocate its scores buffer")
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F.rms_norm over the last dim of x [rows, dim]. With residual, x += residual first, in place."""
        assert x.is_contiguous() and (residual is None or residual.is_contiguous())
        out = torch.empty_like(x)
        rows, dim = x.shape
        res_ptr = None if residual is None else residual.data_ptr()
        self._lib.rms_norm_f32(x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), rows, dim, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * dim] -> silu(gate) * up [rows, dim]."""
        return self._gated_mul(self._lib.silu_mul_f32, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * dim] -> gelu(gate, approximate="tanh") * up [rows, dim]."""
        return self._gated_mul(self._lib.gelu_tanh_mul_f32, gate_up)

    @staticmethod
    def _gated_mul(kernel, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        kernel(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def gated_delta_decode(
        self,
        states: torch.Tensor,  # [slots, heads, dk, dv] float32, the rows of `slots` updated in place
        slots: torch.Tensor,  # [rows] int64
        q: torch.Tensor,  # [rows, heads, dk]
        k: torch.Tensor,  # [rows, heads, dk]
        v: torch.Tensor,  # [rows, heads, dv]
        beta: torch.Tensor,  # [rows, heads]
        log_decay: torch.Tensor,  # [rows, heads]
    ) -> torch.Tensor:  # [rows, heads, dv]
        """One step of the gated delta rule per row (linear_attention.py), in place in the pool."""
        rows, heads, dk = q.shape
        dv = v.shape[-1]
        assert states.is_contiguous() and states.dtype == torch.float32 and states.shape[1:] == (heads, dk, dv)
        q, k, v, beta, log_decay = (t.float().contiguous() for t in (q, k, v, beta, log_decay))
        slots = slots.contiguous()
        out = torch.empty((rows, heads, dv), dtype=torch.float32)
        ptrs = (states, slots, q, k, v, beta, log_decay, out)
        self._lib.gated_delta_decode_f32(*(t.data_ptr() for t in ptrs), rows, heads, dk, dv)
        return out

    def rope_and_cache(
        self,
        qkv: torch.Tensor,  # [tokens, (heads + 2 * kv_heads) * head_dim], rotated in place
        positions: torch.Tensor,  # [tokens] int64
        cos: torch.Tensor | None,  # [max_positions, rotary_dim]; None: a layer without RoPE
        sin: torch.Tensor | None,
        k_cache: torch.Tensor,  # [num_blocks, kv_heads, head_dim, block_size]
        v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [tokens] int64
        num_heads: int,
    ) -> None:
        """RoPE on q and k in place (cos given; on each head's first rotary_dim = cos.shape[-1]
        features), then the new k and v written into the paged cache."""
        assert qkv.is_contiguous() and positions.dtype == slot_mapping.dtype == torch.int64
        _, kv_heads, head_dim, block_size = k_cache.shape
        cos_ptr, sin_ptr = (None, None) if cos is None or sin is None else (cos.data_ptr(), sin.data_ptr())
        self._lib.rope_and_cache_f32(
            qkv.data_ptr(),
            positions.data_ptr(),
            cos_ptr,
            sin_ptr,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            qkv.shape[0],
            num_heads,
            kv_heads,
            head_dim,
            head_dim if cos is None else cos.shape[-1],
            block_size,
        )

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, cols] fp32 -> (q [rows, cols] int8, scale [rows, 1] fp32), x ~= q * scale:
        per row, scale = max|x| / 127, values rounded half to even."""
        x = x.contiguous()
        rows, cols = x.shape
        q = torch.empty((rows, cols), dtype=torch.int8)
        scale = torch.empty((rows, 1), dtype=torch.float32)
        self._lib.quantize_rows_i8(x.data_ptr(), q.data_ptr(), scale.data_ptr(), rows, cols)
        return q, scale

    def dequantize(
        self,
        acc: torch.Tensor,  # [rows, cols] int32 sums of an int8 matmul
        row_scale: torch.Tensor,  # [rows, 1] the activations' scales
        col_scale: torch.Tensor,  # [cols] the weight's scales per output channel
        bias: torch.Tensor,  # [cols]
        *,
        gelu: bool = False,
        requantize: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """acc * row_scale * col_scale + bias (then exact GELU when `gelu`), fp32 [rows, cols];
        with `requantize`, that result quantized per row instead, as quantize_rows gives it (the
        float values never leave the kernel's stack)."""
        rows, cols = acc.shape
        _check_glue(acc, row_scale, col_scale, bias)
        if requantize and cols <= _MAX_STACK_ROW:
            q = torch.empty((rows, cols), dtype=torch.int8)
            q_scale = torch.empty((rows, 1), dtype=torch.float32)
            self._lib.dequant_i32_f32(
                acc.data_ptr(), row_scale.data_ptr(), col_scale.data_ptr(), bias.data_ptr(),
                None, q.data_ptr(), q_scale.data_ptr(), rows, cols, int(gelu),
            )  # fmt: skip
            return q, q_scale
        out = torch.empty((rows, cols), dtype=torch.float32)
        self._lib.dequant_i32_f32(
            acc.data_ptr(), row_scale.data_ptr(), col_scale.data_ptr(), bias.data_ptr(),
            out.data_ptr(), None, None, rows, cols, int(gelu),
        )  # fmt: skip
        return self.quantize_rows(out) if requantize else out

    def dequantize_add_layer_norm(
        self,
        acc: torch.Tensor,  # [rows, cols] int32 sums of an int8 matmul
        row_scale: torch.Tensor,  # [rows, 1]
        col_scale: torch.Tensor,  # [cols]
        bias: torch.Tensor,  # [cols]
        residual: torch.Tensor,  # [rows, cols] fp32
        ln_weight: torch.Tensor,
        ln_bias: torch.Tensor,
        eps: float,
        *,
        requantize: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(F.layer_norm(residual + acc * row_scale * col_scale + bias), and with `requantize` that
        result quantized per row (q, scale) for the next matmul, else None, None)."""
        rows, cols = acc.shape
        _check_glue(acc, row_scale, col_scale, bias)
        residual = residual.contiguous()
        if residual.shape != acc.shape or residual.dtype != torch.float32:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not fit sums {tuple(acc.shape)}")
        if not (ln_weight.numel() == ln_bias.numel() == cols and ln_weight.dtype == ln_bias.dtype == torch.float32):
            raise ValueError(f"LayerNorm takes fp32 weight and bias of {cols} values")
        out = torch.empty((rows, cols), dtype=torch.float32)
        q = torch.empty((rows, cols), dtype=torch.int8) if requantize else None
        q_scale = torch.empty((rows, 1), dtype=torch.float32) if requantize else None
        self._lib.dequant_add_layer_norm_f32(
            acc.data_ptr(), row_scale.data_ptr(), col_scale.data_ptr(), bias.data_ptr(), residual.data_ptr(),
            ln_weight.contiguous().data_ptr(), ln_bias.contiguous().data_ptr(), out.data_ptr(), _ptr(q),
            _ptr(q_scale), rows, cols, eps,
        )  # fmt: skip
        return out, q, q_scale

    def window_attention(
        self, qkv: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, num_heads: int
    ) -> torch.Tensor:
        """Bidirectional attention within windows of back-to-back tokens (an encoder batch):
        qkv [tokens, 3 * hidden] (q | k | v), window w is rows [starts[w], starts[w] + lens[w])
        (int64); returns [tokens, hidden], scale head_dim ** -0.5, no padding and no mask."""
        qkv = qkv.contiguous()
        tokens, width = qkv.shape
        head_dim = width // 3 // num_heads
        if head_dim % self.vector_floats or head_dim > 256 or width != 3 * num_heads * head_dim:
            raise ValueError(f"window attention takes head_dim a multiple of {self.vector_floats} up to 256")
        if qkv.dtype != torch.float32 or starts.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("window attention takes fp32 qkv and int64 window starts and lengths")
        if len(starts) and (int((starts + lens).max()) > tokens or int(starts.min()) < 0):
            raise ValueError("a window lies outside the batch's tokens")
        out = torch.empty((tokens, width // 3), dtype=torch.float32)
        status = self._lib.window_attention_f32(
            qkv.data_ptr(), starts.data_ptr(), lens.data_ptr(), out.data_ptr(), len(starts), num_heads, head_dim,
            head_dim**-0.5,
        )  # fmt: skip
        if status != 0:
            raise MemoryError("window attention could not allocate its scratch memory")
        return out

    def pack_int8(self, weight: torch.Tensor) -> PackedInt8 | None:
        """weight [in_features, out_features] int8 with values in -63..63 -> packed for int8_gemm;
        None when its shape does not fit the kernel (in_features % 4, out_features % block)."""
        weight = weight.contiguous()
        k, n = weight.shape
        block = int(self._lib.int8_gemm_block())
        if weight.dtype != torch.int8 or not block:
            return None
        blocks = torch.empty((n // block, k // 4, block, 4), dtype=torch.int8)
        colsum128 = torch.empty(n, dtype=torch.int32)
        if self._lib.int8_gemm_pack(weight.data_ptr(), blocks.data_ptr(), colsum128.data_ptr(), k, n) != 0:
            if weight.abs().max() > 63:
                raise ValueError("int8_gemm takes weights in -63..63 (7 bits)")
            return None
        return PackedInt8(blocks, colsum128, k, n, self)

    def int8_gemm(self, x: torch.Tensor, weight: PackedInt8) -> torch.Tensor:
        """x [rows, in_features] int8 in -127..127 @ the packed weight -> int32 [rows, out_features]:
        the exact sums, as torch._int_mm gives them."""
        x = x.contiguous()
        rows, k = x.shape
        if x.dtype != torch.int8 or k != weight.in_features or weight.kernels is not self:
            raise ValueError(f"int8_gemm takes int8 [rows, {weight.in_features}] for a weight packed by this mode")
        out = torch.empty((rows, weight.out_features), dtype=torch.int32)
        if rows:
            self._lib.int8_gemm(
                x.data_ptr(), weight.blocks.data_ptr(), weight.colsum128.data_ptr(), out.data_ptr(), rows,
                weight.out_features, k, int(self.has_vnni),
            )  # fmt: skip
        return out

    def decode_stack(self, layers, kv_caches, specs: tuple[StackLayer, ...], shape: StackShape) -> DecodeStack:
        return DecodeStack(self._lib, layers, kv_caches, specs, shape)


def _has_vnni(mode: str) -> bool:
    from engine.native.kernels import cpu_flags

    return ("avx512_vnni" if mode == "avx512" else "avx_vnni") in cpu_flags()


_MAX_STACK_ROW = 8192  # int8_glue.c's MAX_STACK_ROW


def _check_glue(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor) -> None:
    """The C glue reads these as contiguous int32 / fp32 arrays of the sums' shape: anything else
    would read past them."""
    rows, cols = acc.shape
    ok = (
        acc.dtype == torch.int32
        and acc.is_contiguous()
        and row_scale.dtype == col_scale.dtype == bias.dtype == torch.float32
        and row_scale.is_contiguous()
        and col_scale.is_contiguous()
        and bias.is_contiguous()
        and row_scale.numel() == rows
        and col_scale.numel() == bias.numel() == cols
    )
    if not ok:
        raise ValueError(
            "int8 glue takes contiguous int32 sums [rows, cols], fp32 scales [rows] and [cols], bias [cols]"
        )


def _scales_ptr(weight: PackedLinear) -> int:
    return 0 if weight.scales is None else weight.scales.data_ptr()


def _ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


@dataclass(frozen=True, slots=True)
class StackLayer:
    """How one layer attends in the decode stack, besides its weights and KV cache."""

    rope: tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) [max_positions, rotary_dim]; None: no RoPE
    sliding_window: int | None  # None: the whole context
    kv_group: int  # 0: the global layers' KV group; 1: a hybrid model's sliding layers' (window_group)


@dataclass(frozen=True, slots=True)
class StackShape:
    """The model-wide numbers of the decode stack."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float  # q.k's, head_dim ** -0.5 unless the family sets it
    softcap: float | None  # attention logits' soft-cap (Gemma 2)
    gelu_tanh: bool  # the MLP's activation: GELU-tanh (Gemma), else SiLU
    qk_norm_whole: bool  # q/k norms over the whole projection (OLMo 2), else per head


class DecodeStack:
    """Runs every layer of a decode-only step in one call (csrc/decode_step.c).

    Holds the per-layer addresses of the packed weights, norms, RoPE tables and the KV cache, so
    it must live no longer than the weights, tables and cache it was built from (the model keeps
    it beside them). The row layout is decode_step.c's field enum, in its order.
    """

    def __init__(self, lib, layers, kv_caches, specs: tuple[StackLayer, ...], shape: StackShape):
        rows = []
        for layer, (k_cache, v_cache), spec in zip(layers, kv_caches, specs, strict=True):
            cos, sin = spec.rope if spec.rope is not None else (None, None)
            rows.append(
                [
                    _ptr(layer.input_norm),
                    layer.qkv.panels.data_ptr(),
                    _ptr(layer.qkv_bias),
                    layer.o_proj.panels.data_ptr(),
                    _ptr(layer.post_norm),
                    layer.gate_up.panels.data_ptr(),
                    layer.down.panels.data_ptr(),
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                    *(_scales_ptr(w) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)),
                    _ptr(layer.q_norm),
                    _ptr(layer.k_norm),
                    int(shape.qk_norm_whole),
                    _ptr(cos),
                    _ptr(sin),
                    shape.head_dim if cos is None else cos.shape[-1],
                    _ptr(layer.attn_out_norm),
                    _ptr(layer.mlp_out_norm),
                    spec.sliding_window or 0,
                    spec.kv_group,
                    layer.qkv.bits,
                ]
            )
        self._lib = lib
        self._keep = (layers, kv_caches, specs)
        self.kv_cache_ptr = kv_caches[0][0].data_ptr()
        self._table = torch.tensor(rows, dtype=torch.int64)
        s = shape
        self._dims = (len(rows), s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, kv_caches[0][0].shape[-1])
        self._floats = (s.eps, s.scale, s.softcap or 0.0)
        self._gelu = int(s.gelu_tanh)
        self._scratch_per_token = (
            3 * s.hidden + (s.heads + 2 * s.kv_heads) * s.head_dim + 2 * s.heads * s.head_dim + 3 * s.intermediate
        )

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [tokens, hidden] (the embeddings) becomes the residual stream after the last layer, in
        place. meta: a decode-only step's, with the kernel's block tables (and, in a hybrid model,
        its window_group's for the sliding layers)."""
        window = meta.window_group or meta
        table, window_table, lens = meta.decode_block_tables, window.decode_block_tables, meta.decode_context_lens
        assert table is not None and window_table is not None and lens is not None
        assert x.is_contiguous() and table.shape == window_table.shape
        assert all(t.is_contiguous() and t.dtype == torch.int32 for t in (table, window_table, lens))
        slots = (ctypes.c_int64 * 2)(meta.slot_mapping.data_ptr(), window.slot_mapping.data_ptr())
        table_ptrs = (ctypes.c_int64 * 2)(table.data_ptr(), window_table.data_ptr())
        tokens = x.shape[0]
        scratch = torch.empty(tokens * self._scratch_per_token, dtype=torch.float32)
        status = self._lib.decode_layers_f32(
            x.data_ptr(),
            positions.data_ptr(),
            ctypes.addressof(slots),
            ctypes.addressof(table_ptrs),
            lens.data_ptr(),
            table.shape[1],
            meta.decode_max_context_len,
            tokens,
            self._table.data_ptr(),
            *self._dims,
            self._gelu,
            *self._floats,
            scratch.data_ptr(),
        )
        if status != 0:
            raise MemoryError("the decode step could not allocate scratch memory (attention scores, int4 inputs)")
        return x
