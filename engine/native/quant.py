"""Weight-only quantization, done once at load: per-group scales, like llama.cpp's Q8_0 and Q4_0.

Each row of a weight [out_features, in_features] is cut into groups of 32 consecutive inputs;
a group stores small integers and one fp32 scale, so w ~ q * scale:
- int8 (Q8_0-like): q in -127..127, scale = max |w| / 127;
- int4 (Q4_0-like): q in -8..7, scale = (the group's weight of largest magnitude) / -8, so that
  weight maps to -8 exactly and the other end keeps 7 steps (Q4_0's choice).
int8 keeps activations fp32: the kernels widen q in registers. int4 quantizes the activations too
(w4a8, llama.cpp's Q4_0 x Q8_0): per row and group of 32 inputs, int8 with scale max |x| / 127,
so that the kernels sum integer products (csrc/packed_linear.c); `quantize_activations` is that
rounding for paths without those kernels. Owns only the arithmetic; the panel layouts belong to
cpu_ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

GROUP_SIZE = 32  # inputs per scale (Q8_0's and Q4_0's block); GROUP in csrc/packed_linear.c


class Quantization(Enum):
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int:
        return {Quantization.NONE: 32, Quantization.INT8: 8, Quantization.INT4: 4}[self]


@dataclass(frozen=True, slots=True)
class Int8Weight:
    q: torch.Tensor  # [out_features, in_features] int8 (int4: values in -8..7)
    scales: torch.Tensor  # [out_features, ceil(in_features / GROUP_SIZE)] fp32


def _groups(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [n, ceil(k / GROUP_SIZE), GROUP_SIZE] fp32, zero-padded past k."""
    n, k = weight.shape
    groups = -(-k // GROUP_SIZE)
    padded = torch.zeros((n, groups * GROUP_SIZE), dtype=torch.float32, device=weight.device)
    padded[:, :k] = weight.detach().to(torch.float32)
    return padded.view(n, groups, GROUP_SIZE)


def _round(grouped: torch.Tensor, scales: torch.Tensor, low: int, high: int, k: int) -> Int8Weight:
    inverse = torch.where(scales != 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(grouped * inverse[..., None]).clamp_(low, high).to(torch.int8)
    n = grouped.shape[0]
    return Int8Weight(q.view(n, -1)[:, :k].contiguous(), scales.contiguous())


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Round each group of 32 inputs of each row to int8 with its own scale."""
    grouped = _groups(weight)
    return _round(grouped, grouped.abs().amax(dim=-1) / 127.0, -127, 127, weight.shape[1])


def quantize_int4(weight: torch.Tensor) -> Int8Weight:
    """Round each group of 32 inputs of each row to 4 bits (-8..7) with its own scale."""
    grouped = _groups(weight)
    extreme = grouped.gather(-1, grouped.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)  # signed
    return _round(grouped, extreme / -8.0, -8, 7, weight.shape[1])


# Rows rounded at a time: each row's groups are independent, and the float temporaries of a whole
# large matrix (a 152k-token lm_head: three of 1.2 GB each) would set the load's peak.
_QUANTIZE_ROWS = 4096


def quantize(weight: torch.Tensor, quantization: Quantization) -> Int8Weight:
    if quantization is Quantization.INT4:
        rows = quantize_int4
    elif quantization is Quantization.INT8:
        rows = quantize_int8
    else:
        raise ValueError(f"{quantization.value} is not a quantization")
    if weight.shape[0] <= _QUANTIZE_ROWS:
        return rows(weight)
    parts = [rows(weight[i : i + _QUANTIZE_ROWS]) for i in range(0, weight.shape[0], _QUANTIZE_ROWS)]
    return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]))


def dequantize(weight: Int8Weight) -> torch.Tensor:
    """The fp32 weight [out_features, in_features] that the quantized kernels compute with."""
    k = weight.q.shape[1]
    scales = weight.scales.repeat_interleave(GROUP_SIZE, dim=1)[:, :k]
    return weight.q.to(torch.float32) * scales


def fake_quantize(weight: torch.Tensor, quantization: Quantization = Quantization.INT8) -> torch.Tensor:
    """The weight rounded as the quantized kernels round it, kept in its dtype: the same numbers
    on paths without those kernels (PyTorch ops, CUDA), so every path computes the same model."""
    return dequantize(quantize(weight, quantization)).to(weight.dtype)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] rounded as the int4 kernels round their inputs, kept in its dtype: per group of
    32 along the last dimension, to int8 with scale max |x| / 127 (half to even)."""
    k = x.shape[-1]
    groups = -(-k // GROUP_SIZE)
    padded = torch.zeros((*x.shape[:-1], groups * GROUP_SIZE), dtype=torch.float32, device=x.device)
    padded[..., :k] = x.to(torch.float32)
    grouped = padded.view(*x.shape[:-1], groups, GROUP_SIZE)
    scale = grouped.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(grouped / scale), torch.zeros_like(grouped))
    return (q * scale).view(*x.shape[:-1], groups * GROUP_SIZE)[..., :k].to(x.dtype)


@dataclass(frozen=True, slots=True)
class W4A8Weight:
    """An int4 layer on paths without the kernels (PyTorch ops, CUDA): the weight rounded to 4 bits
    and kept as floats; its inputs are rounded with `quantize_activations` before the matmul."""

    weight: torch.Tensor  # [out_features, in_features], fake_quantize(..., INT4)
