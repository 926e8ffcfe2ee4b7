"""The compiled CPU kernels for the linear layers and the fused small ops, against PyTorch, built
for every instruction set this CPU has (AVX-512, AVX2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.native import kernels
from engine.native.kernels import KernelMode
from engine.native.quant import (
    GROUP_SIZE,
    Quantization,
    dequantize,
    quantize_activations,
    quantize_int4,
    quantize_int8,
)
from engine.types import EngineError
from kernel_modes import COMPILED_MODES, cpu_kernels


@pytest.fixture(params=COMPILED_MODES)
def cpu(request):
    return cpu_kernels(request.param)


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 11, 12, 13, 32, 77])
@pytest.mark.parametrize("out_features,in_features", [(768, 512), (40, 24), (17, 3), (33, 130)])
def test_packed_linear_matches_f_linear(cpu, rows, out_features, in_features):
    # Output widths that are not whole panels (40, 17, 33) and row counts around both tiles (6, 12 rows).
    torch.manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)
    packed = cpu.pack_linear(w)
    assert packed.shape == (out_features, in_features)
    torch.testing.assert_close(cpu.packed_linear(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 24, 25, 77])
@pytest.mark.parametrize("out_features,in_features", [(96, 256), (40, 24), (33, 130)])
def test_int8_packed_linear_computes_with_the_dequantized_weights(cpu, rows, out_features, in_features):
    # in_features 24 and 130: a last group shorter than 32.
    torch.manual_seed(rows + out_features)
    w, b = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(rows, in_features)
    packed = cpu.pack_linear(w, Quantization.INT8)
    assert packed.panels.dtype == torch.int8
    if out_features % cpu.panel == 0 and in_features % GROUP_SIZE == 0:  # no padding: 1.125 bytes a weight
        assert packed.nbytes == w.numel() * 9 // 8
    expected = F.linear(x, dequantize(quantize_int8(w)), b)
    torch.testing.assert_close(cpu.packed_linear(x, packed, b), expected, atol=1e-4, rtol=1e-4)


def vnni_paths(cpu) -> list[bool]:
    """The int8 dot-product instruction sequences this CPU runs: vpmaddubsw always, VNNI where it has it."""
    return [False, True] if cpu.has_vnni else [False]


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13, 24, 25, 77])
@pytest.mark.parametrize("out_features,in_features", [(96, 256), (40, 24), (33, 131), (17, 3)])
def test_int4_packed_linear_computes_with_the_dequantized_weights_on_rounded_inputs(
    cpu, rows, out_features, in_features
):
    # w4a8: the inputs are rounded per group of 32 (quantize_activations) and the products summed
    # as integers. in_features 131 and 3: a last group shorter than 32 (padded with zeros); row
    # counts around both tiles (2 rows with AVX2, 4 with AVX-512).
    torch.manual_seed(rows + out_features)
    w, b = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(rows, in_features)
    x[0, :4] = 0.0  # a group's largest inputs zero...
    x[-1, : min(32, in_features)] = 0.0  # ...and a whole group of zeros (scale 0)
    packed = cpu.pack_linear(w, Quantization.INT4)
    assert packed.bits == 4 and packed.panels.dtype == torch.uint8
    if out_features % cpu.panel == 0 and in_features % GROUP_SIZE == 0:  # no padding: 0.625 bytes a weight
        assert packed.nbytes == w.numel() * 5 // 8
    expected = F.linear(quantize_activations(x), dequantize(quantize_int4(w)), b)
    paths = vnni_paths(cpu)
    try:
        results = []
        for vnni in paths:
            cpu.use_vnni(vnni)
            results.append(cpu.packed_linear(x, packed, b))
            torch.testing.assert_close(results[-1], expected, atol=1e-4, rtol=1e-4, msg=f"vnni={vnni}")
    finally:
        cpu.use_vnni(paths[-1])
    assert all(torch.equal(r, results[0]) for r in results)  # exact integer sums: the same on both


def test_int4_rows_give_the_same_sums_alone_and_in_a_batch(cpu):
    # Each row's inputs are rounded on their own and the sums are exact integers, so a row's
    # output does not depend on its batch.
    torch.manual_seed(4)
    w, b = torch.randn(100, 200), torch.randn(100)
    x = torch.randn(50, 200)
    packed = cpu.pack_linear(w, Quantization.INT4)
    alone = torch.cat([cpu.packed_linear(x[i : i + 1], packed, b) for i in range(len(x))])
    assert torch.equal(cpu.packed_linear(x, packed, b), alone)


def test_int4_a_row_with_nan_or_inf_leaves_the_other_rows_alone(cpu):
    torch.manual_seed(8)
    w, x = torch.randn(40, 70), torch.randn(3, 70)
    packed = cpu.pack_linear(w, Quantization.INT4)
    clean = cpu.packed_linear(x[2:], packed)
    x[0, 5], x[1, 40] = float("nan"), float("inf")
    assert torch.equal(cpu.packed_linear(x, packed)[2:], clean)


def test_activations_round_like_q8_0():
    torch.manual_seed(6)
    x = torch.randn(3, 70) * torch.logspace(-2, 2, 70)
    x[1, 32:64] = 0.0
    rounded = quantize_activations(x)
    assert torch.equal(rounded[1, 32:64], torch.zeros(32))
    for g in range(3):
        part, got = x[:, g * 32 : (g + 1) * 32], rounded[:, g * 32 : (g + 1) * 32]
        step = part.abs().amax(dim=1, keepdim=True) / 127
        assert bool(((got - part).abs() <= step / 2 * 1.0001 + 1e-12).all())


def test_int4_rounds_like_q4_0():
    # Per group of 32: the weight of largest magnitude maps to -8 exactly, the rest to -8..7.
    torch.manual_seed(5)
    w = torch.randn(6, 64)
    w[0, 3] = 5.0  # a positive extreme: its scale is negative
    quantized = quantize_int4(w)
    assert int(quantized.q.min()) >= -8 and int(quantized.q.max()) <= 7 and quantized.q[0, 3] == -8
    error = (dequantize(quantized) - w).abs()
    step = quantized.scales.abs().repeat_interleave(GROUP_SIZE, dim=1)
    assert bool((error <= step * 1.000001).all())  # within one step (7 steps on the extreme's other side)


def test_int8_rows_give_the_same_sums_alone_and_in_a_batch(cpu):
    # From 2 tiles of rows on, the kernel widens each int8 panel to fp32 once instead of in
    # registers for every tile: the same numbers, so a row's output does not depend on its batch.
    torch.manual_seed(3)
    w, b = torch.randn(100, 200), torch.randn(100)
    x = torch.randn(50, 200)
    packed = cpu.pack_linear(w, Quantization.INT8)
    batch = cpu.packed_linear(x, packed, b)
    alone = torch.cat([cpu.packed_linear(x[i : i + 1], packed, b) for i in range(len(x))])
    torch.testing.assert_close(batch, alone, atol=1e-6, rtol=1e-6)


def test_int8_rounding_error_is_within_half_a_step_of_each_group():
    torch.manual_seed(5)
    w = torch.randn(64, 100) * torch.logspace(-3, 1, 100)  # groups of very different magnitudes
    quantized = quantize_int8(w)
    assert quantized.q.dtype == torch.int8 and quantized.scales.shape == (64, -(-100 // GROUP_SIZE))
    step = quantized.scales.repeat_interleave(GROUP_SIZE, dim=1)[:, :100]
    assert ((dequantize(quantized) - w).abs() <= step / 2 + 1e-7).all()
    assert quantized.q.abs().max() == 127


def test_packed_linear_with_bias_and_strided_input(cpu):
    torch.manual_seed(1)
    w, b = torch.randn(50, 64), torch.randn(50)
    x = torch.randn(64, 9).t()  # not contiguous: the kernel gets a contiguous copy
    torch.testing.assert_close(cpu.packed_linear(x, cpu.pack_linear(w), b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_packed_linear_rejects_a_wrong_input_width(cpu):
    packed = cpu.pack_linear(torch.randn(8, 16))
    with pytest.raises(ValueError, match="16"):
        cpu.packed_linear(torch.randn(2, 15), packed)


def test_fused_rms_norm_adds_the_residual_in_place_then_normalises(cpu):
    torch.manual_seed(2)
    x, res, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    expected_x = x + res
    out = cpu.rms_norm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(out, F.rms_norm(expected_x, (96,), w, 1e-5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6), atol=1e-5, rtol=1e-5)


def test_fused_silu_mul(cpu):
    gate_up = torch.randn(7, 2 * 40) * 4
    torch.testing.assert_close(cpu.silu_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:], atol=1e-5, rtol=1e-5)


def test_fused_gelu_tanh_mul(cpu):
    gate_up = torch.randn(7, 2 * 40) * 4
    expected = F.gelu(gate_up[:, :40], approximate="tanh") * gate_up[:, 40:]
    torch.testing.assert_close(cpu.gelu_tanh_mul(gate_up), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotary_dim", [16, 8, 12])  # the whole head, Phi-3's partial rotary
def test_rope_and_cache_matches_the_pytorch_path(cpu, rotary_dim):
    from engine.native.attention import AttentionMetadata, write_kv_cache
    from engine.native.model import _rotate

    torch.manual_seed(3)
    heads, kv_heads, head_dim, block_size, num_blocks, tokens = 4, 2, 16, 8, 6, 5
    positions = torch.tensor([0, 3, 9, 17, 30])
    slots = torch.tensor([1, 12, 47, 8, 30])
    table = torch.randn(40, rotary_dim)
    cos, sin = table.cos(), table.sin()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    caches = [
        (
            torch.zeros(num_blocks, kv_heads, head_dim, block_size),
            torch.zeros(num_blocks * block_size, kv_heads, head_dim),
        )
        for _ in range(2)
    ]
    # The PyTorch path: rotate q and k, write k and v through the metadata.
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qk = _rotate(qkv[:, : q_size + kv_size].reshape(tokens, -1, head_dim), cos[positions, None], sin[positions, None])
    meta = AttentionMetadata(
        slot_mapping=slots,
        slot_blocks=slots // block_size,
        slot_offsets=slots % block_size,
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        decode_max_context_len=0,
        decode_slots=None,
        decode_mask=None,
        prefills=(),
        block_size=block_size,
    )
    write_kv_cache(qk[:, heads:], qkv[:, q_size + kv_size :].reshape(tokens, kv_heads, head_dim), *caches[0], meta)
    fused = qkv.clone()
    cpu.rope_and_cache(fused, positions, cos, sin, *caches[1], slots, heads)
    torch.testing.assert_close(fused[:, : q_size + kv_size].view(tokens, -1, head_dim), qk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[:, q_size + kv_size :], qkv[:, q_size + kv_size :])
    for ref, got in zip(caches[0], caches[1], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_the_mode_is_resolved_from_the_settings_and_the_cpu():
    cpu, fp32 = torch.device("cpu"), torch.float32
    best = kernels.supported_modes()[0] if kernels.supported_modes() else KernelMode.TORCH
    assert kernels.resolve_mode(enabled=True, isa="auto", device=cpu, dtype=fp32) in (best, KernelMode.TORCH)
    assert kernels.resolve_mode(enabled=False, isa="auto", device=cpu, dtype=fp32) is KernelMode.TORCH
    assert kernels.resolve_mode(enabled=True, isa="auto", device=cpu, dtype=torch.bfloat16) is KernelMode.TORCH
    assert kernels.resolve_mode(enabled=True, isa="torch", device=cpu, dtype=fp32) is KernelMode.TORCH
    with pytest.raises(EngineError, match="kernel_isa 'sse9'"):
        kernels.resolve_mode(enabled=True, isa="sse9", device=cpu, dtype=fp32)
    for mode in (KernelMode.AVX512, KernelMode.AVX2):
        if mode not in kernels.supported_modes():
            with pytest.raises(EngineError, match="supports only"):
                kernels.resolve_mode(enabled=True, isa=mode.value, device=cpu, dtype=fp32)


# The int8 glue (csrc/int8_glue.c): the float work between the safety encoder's w8a8 matmuls.


def _quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def _assert_same_quantization(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    (q, scale), (want_q, want_scale) = got, want
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    # A multiply by the reciprocal instead of a division may move a value sitting on a
    # rounding tie to the next step: rare, and never further.
    diff = (q.int() - want_q.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3


@pytest.mark.parametrize("rows,cols", [(1, 384), (7, 37), (130, 1536)])
def test_quantize_rows_matches_pytorch(cpu, rows, cols):
    x = torch.randn(rows, cols) * 3
    x[0] = 0.0  # an all-zero row: scale at its floor, all zeros
    q, scale = cpu.quantize_rows(x)
    _assert_same_quantization((q, scale), _quantize_rows_reference(x))
    assert not q[0].any()
    assert cpu.quantize_rows(torch.zeros(0, cols))[0].shape == (0, cols)


def _int8_sums(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    acc = (torch.randn(rows, cols, generator=gen) * 4000).to(torch.int32)
    row_scale = torch.rand(rows, 1, generator=gen) * 1e-3 + 1e-4
    col_scale = torch.rand(cols, generator=gen) + 0.5
    bias = torch.randn(cols, generator=gen)
    return acc, row_scale, col_scale, bias


@pytest.mark.parametrize("rows,cols", [(1, 8), (5, 1152), (77, 1536)])
def test_dequantize_with_and_without_gelu_and_requantized(cpu, rows, cols):
    acc, row_scale, col_scale, bias = _int8_sums(rows, cols)
    want = acc.float() * row_scale * col_scale + bias
    torch.testing.assert_close(cpu.dequantize(acc, row_scale, col_scale, bias), want, rtol=1e-5, atol=1e-5)
    want_gelu = F.gelu(want)  # the exact (erf) GELU, as BERT's
    got_gelu = cpu.dequantize(acc, row_scale, col_scale, bias, gelu=True)
    torch.testing.assert_close(got_gelu, want_gelu, rtol=1e-5, atol=2e-6)
    requantized = cpu.dequantize(acc, row_scale, col_scale, bias, gelu=True, requantize=True)
    _assert_same_quantization(requantized, _quantize_rows_reference(got_gelu))


@pytest.mark.parametrize("rows", [1, 3, 100])
def test_dequantize_add_layer_norm_matches_pytorch(cpu, rows):
    cols = 384
    acc, row_scale, col_scale, bias = _int8_sums(rows, cols)
    residual, weight, ln_bias = torch.randn(rows, cols), torch.rand(cols) + 0.5, torch.randn(cols)
    want = F.layer_norm(residual + acc.float() * row_scale * col_scale + bias, (cols,), weight, ln_bias, 1e-12)
    out, q, q_scale = cpu.dequantize_add_layer_norm(acc, row_scale, col_scale, bias, residual, weight, ln_bias, 1e-12)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert q is None and q_scale is None
    out, q, q_scale = cpu.dequantize_add_layer_norm(
        acc, row_scale, col_scale, bias, residual, weight, ln_bias, 1e-12, requantize=True
    )
    _assert_same_quantization((q, q_scale), _quantize_rows_reference(out))


def test_the_glue_refuses_what_it_would_misread(cpu):
    acc, row_scale, col_scale, bias = _int8_sums(4, 16)
    with pytest.raises(ValueError, match="int32"):
        cpu.dequantize(acc.long(), row_scale, col_scale, bias)
    with pytest.raises(ValueError, match="int32"):
        cpu.dequantize(acc, row_scale, col_scale[:8], bias)
    with pytest.raises(ValueError, match="residual"):
        cpu.dequantize_add_layer_norm(acc, row_scale, col_scale, bias, torch.zeros(4, 8), bias, bias, 1e-5)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_window_attention_equals_sdpa_over_each_window_alone(cpu, head_dim):
    heads, lengths = 3, [1, 5, 17, 128, 2, 40]
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim)
    lens = torch.tensor(lengths, dtype=torch.int64)
    got = cpu.window_attention(qkv, torch.cumsum(lens, 0) - lens, lens, heads)
    start = 0
    for n in lengths:
        q, k, v = qkv[start : start + n].view(n, 3, heads, head_dim).permute(1, 2, 0, 3)
        want = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, heads * head_dim)
        torch.testing.assert_close(got[start : start + n], want, rtol=1e-4, atol=1e-5)
        start += n
    with pytest.raises(ValueError, match="head_dim"):
        cpu.window_attention(torch.randn(4, 3 * 2 * 12), torch.tensor([0]), torch.tensor([4]), 2)
    with pytest.raises(ValueError, match="outside"):
        cpu.window_attention(qkv, torch.tensor([0, 300]), torch.tensor([4, 20]), heads)


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 100])
@pytest.mark.parametrize("in_features,out_features", [(384, 1152), (1536, 384), (8, 32)])
def test_int8_gemm_gives_torch_int_mms_exact_sums_with_and_without_vnni(cpu, rows, in_features, out_features):
    gen = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randint(-63, 64, (in_features, out_features), dtype=torch.int8, generator=gen)
    x = torch.randint(-127, 128, (rows, in_features), dtype=torch.int8, generator=gen)
    x[:1] = 127  # the extremes: the widest pair sums of the non-VNNI instructions
    weight[:, :1] = -63
    packed = cpu.pack_int8(weight)
    want = torch._int_mm(x, weight) if rows else torch.zeros(0, out_features, dtype=torch.int32)
    paths = vnni_paths(cpu)
    try:
        for vnni in paths:
            cpu.use_vnni(vnni)
            assert torch.equal(cpu.int8_gemm(x, packed), want), f"vnni={vnni}"
    finally:
        cpu.use_vnni(paths[-1])


def test_int8_gemm_refuses_what_it_cannot_sum_exactly(cpu):
    assert cpu.pack_int8(torch.zeros(6, 32, dtype=torch.int8)) is None  # in_features not a multiple of 4
    assert cpu.pack_int8(torch.zeros(8, 24, dtype=torch.int8)) is None  # out_features not a multiple of the block
    with pytest.raises(ValueError, match=r"-63\.\.63"):
        cpu.pack_int8(torch.full((8, 32), 64, dtype=torch.int8))
    packed = cpu.pack_int8(torch.zeros(8, 32, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8_gemm takes"):
        cpu.int8_gemm(torch.zeros(2, 12, dtype=torch.int8), packed)
