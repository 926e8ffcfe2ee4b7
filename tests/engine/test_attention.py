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
