"""The compiled CPU kernels for the linear layers and the fused small ops, against PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.native import kernels

pytestmark = pytest.mark.skipif(
    not kernels.packed_linear_available(), reason="no C compiler or no AVX-512: the engine uses its PyTorch ops"
)


@pytest.mark.parametrize("rows", [0, 1, 2, 11, 12, 13, 32, 77, 300])
@pytest.mark.parametrize("out_features,in_features", [(768, 512), (40, 24), (17, 3), (33, 130)])
def test_packed_linear_matches_f_linear(rows, out_features, in_features):
    # Output widths that are not whole panels (40, 17, 33) and row counts around the 12-row tile.
    torch.manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)
    packed = kernels.pack_linear(w)
    assert packed.shape == (out_features, in_features)
    torch.testing.assert_close(kernels.packed_linear(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_packed_linear_with_bias_and_strided_input():
    torch.manual_seed(1)
    w, b = torch.randn(50, 64), torch.randn(50)
    x = torch.randn(64, 9).t()  # not contiguous: the kernel gets a contiguous copy
    torch.testing.assert_close(kernels.packed_linear(x, kernels.pack_linear(w), b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_packed_linear_rejects_a_wrong_input_width():
    packed = kernels.pack_linear(torch.randn(8, 16))
    with pytest.raises(ValueError, match="16"):
        kernels.packed_linear(torch.randn(2, 15), packed)


def test_fused_rms_norm_adds_the_residual_in_place_then_normalises():
    torch.manual_seed(2)
    x, res, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    expected_x = x + res
    out = kernels.rms_norm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(out, F.rms_norm(expected_x, (96,), w, 1e-5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6), atol=1e-5, rtol=1e-5)


def test_fused_silu_mul():
    gate_up = torch.randn(7, 2 * 40) * 4
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:], atol=1e-5, rtol=1e-5)


def test_rope_and_cache_matches_the_pytorch_path():
    from engine.native.attention import AttentionMetadata, write_kv_cache
    from engine.native.model import _rotate

    torch.manual_seed(3)
    heads, kv_heads, head_dim, block_size, num_blocks, tokens = 4, 2, 16, 8, 6, 5
    positions = torch.tensor([0, 3, 9, 17, 30])
    slots = torch.tensor([1, 12, 47, 8, 30])
    table = torch.randn(40, head_dim)
    cos, sin = table.cos(), table.sin()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    caches = [
        (torch.zeros(num_blocks, kv_heads, head_dim, block_size), torch.zeros(num_blocks * block_size, kv_heads, head_dim))
        for _ in range(2)
    ]
    # The PyTorch path: rotate q and k, write k and v through the metadata.
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qk = _rotate(qkv[:, : q_size + kv_size].reshape(tokens, -1, head_dim), cos[positions, None], sin[positions, None])
    meta = AttentionMetadata(
        slot_mapping=slots, slot_blocks=slots // block_size, slot_offsets=slots % block_size, num_decode_tokens=0,
        decode_block_tables=None, decode_context_lens=None, decode_max_context_len=0, decode_slots=None,
        decode_mask=None, prefills=(), block_size=block_size,
    )
    write_kv_cache(qk[:, heads:], qkv[:, q_size + kv_size :].reshape(tokens, kv_heads, head_dim), *caches[0], meta)
    fused = qkv.clone()
    kernels.rope_and_cache(fused, positions, cos, sin, *caches[1], slots, heads)
    torch.testing.assert_close(fused[:, : q_size + kv_size].view(tokens, -1, head_dim), qk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[:, q_size + kv_size :], qkv[:, q_size + kv_size :])
    for ref, got in zip(caches[0], caches[1], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
