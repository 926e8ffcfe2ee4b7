"""Weight-only int8 quantization, done once at load: per-group scales, like llama.cpp's Q8_0.

Each row of a weight [out_features, in_features] is cut into groups of 32 consecutive inputs;
a group stores int8 values and one fp32 scale (max |w| / 127), so w ~ q * scale. Activations
stay fp32: the kernels widen q in registers (csrc/packed_linear.c). Owns only the arithmetic;
the panel layout belongs to cpu_ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

GROUP_SIZE = 32  # inputs per scale (Q8_0's block); GROUP in csrc/packed_linear.c


class Quantization(Enum):
    NONE = "none"
    INT8 = "int8"


@dataclass(frozen=True, slots=True)
class Int8Weight:
    q: torch.Tensor  # [out_features, in_features] int8
    scales: torch.Tensor  # [out_features, ceil(in_features / GROUP_SIZE)] fp32


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Round each group of 32 inputs of each row to int8 with its own scale."""
    n, k = weight.shape
    groups = -(-k // GROUP_SIZE)
    padded = torch.zeros((n, groups * GROUP_SIZE), dtype=torch.float32, device=weight.device)
    padded[:, :k] = weight.detach().to(torch.float32)
    grouped = padded.view(n, groups, GROUP_SIZE)
    scales = grouped.abs().amax(dim=-1) / 127.0  # [n, groups]
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(grouped * inverse[..., None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.view(n, -1)[:, :k].contiguous(), scales.contiguous())


def dequantize(weight: Int8Weight) -> torch.Tensor:
    """The fp32 weight [out_features, in_features] that the int8 kernels compute with."""
    k = weight.q.shape[1]
    scales = weight.scales.repeat_interleave(GROUP_SIZE, dim=1)[:, :k]
    return weight.q.to(torch.float32) * scales


def fake_quantize(weight: torch.Tensor) -> torch.Tensor:
    """The weight rounded as int8 would round it, kept in its dtype: the same numbers on paths
    without int8 kernels (PyTorch ops, CUDA), so every path computes the same model."""
    return dequantize(quantize_int8(weight)).to(weight.dtype)
