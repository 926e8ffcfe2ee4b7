"""The compiled decode kernel against SDPA on the same paged K/V, over odd context lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_modes import COMPILED_MODES, cpu_kernels


@pytest.mark.parametrize("mode", COMPILED_MODES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(8, 2, 64, 16), (16, 2, 64, 16), (8, 2, 128, 32), (4, 4, 16, 16), (6, 1, 24, 8)],
)
def test_paged_decode_kernel_matches_sdpa_through_block_tables(mode, num_heads, num_kv_heads, head_dim, block_size):
    torch.manual_seed(0)
    lens = torch.tensor([1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * max_blocks + 4
    k_cache = torch.randn(num_blocks, num_kv_heads, head_dim, block_size)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    tables = torch.randperm(num_blocks)[: len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim)
    out = cpu_kernels(mode).paged_decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()))
    for i, length in enumerate(lens.tolist()):
        blocks = tables[i].long()
        keys = k_cache[blocks].permute(1, 0, 3, 2).reshape(num_kv_heads, -1, head_dim)[:, :length]
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:length]
        values = v_cache[slots].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i][:, None], keys, values, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-4)


def _reference(q, k_cache, v_cache, blocks, length, start, scale, softcap):
    """Attention of one query over positions start..length-1, as transformers' eager path does it."""
    num_kv_heads, head_dim, block_size = k_cache.shape[1:]
    keys = k_cache[blocks].permute(1, 0, 3, 2).reshape(num_kv_heads, -1, head_dim)[:, start:length]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[start:length]
    values = v_cache[slots].transpose(0, 1)
    group = q.shape[0] // num_kv_heads
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = torch.einsum("hd,htd->ht", q, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("ht,htd->hd", scores.softmax(-1), values)


@pytest.mark.parametrize("mode", COMPILED_MODES)
@pytest.mark.parametrize("window", [1, 5, 16, 19, None])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (6, 1, 24)])
def test_paged_decode_kernel_attends_within_the_window_and_soft_caps(
    mode, window, softcap, num_heads, num_kv_heads, head_dim
):
    """Blocks wholly before a query's window are never read: here they hold NaN (a released
    block reused by another sequence may hold anything)."""
    torch.manual_seed(1)
    block_size, scale = 16, 0.3
    lens = torch.tensor([1, 15, 16, 17, 40, 83], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * max_blocks + 1
    k_cache = torch.randn(num_blocks, num_kv_heads, head_dim, block_size) * 3
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    poisoned = num_blocks - 1
    k_cache[poisoned] = float("nan")
    v_cache[poisoned * block_size :] = float("nan")
    tables = torch.arange(len(lens) * max_blocks).view(len(lens), max_blocks).to(torch.int32)
    starts = [0 if window is None else max(int(n) - window, 0) for n in lens]
    for row, start in zip(tables, starts, strict=True):
        row[: start // block_size] = poisoned  # released: outside every future window
    q = torch.randn(len(lens), num_heads, head_dim)
    out = cpu_kernels(mode).paged_decode_attention(
        q, k_cache, v_cache, tables, lens, int(lens.max()), scale=scale, sliding_window=window, softcap=softcap
    )
    for i, (length, start) in enumerate(zip(lens.tolist(), starts, strict=True)):
        ref = _reference(q[i], k_cache, v_cache, tables[i].long(), length, start, scale, softcap)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-4)
