"""Attention over the paged KV cache for a flat batch of decode tokens and prefill chunks.

Owns the cache layout, the per-step attention metadata and the two paths that read K/V
through block tables: decode rows (one query per sequence) go to the compiled kernel when it
is available, else to one padded gather + SDPA; prefill chunks gather their context and run
SDPA with a causal mask aligned to the chunk's position. Rows come decodes first, then chunks.

Layout per layer: K blocks transposed, [num_blocks, num_kv_heads, head_dim, block_size], so the
kernel scores 16 tokens per vector op; V as [num_slots, num_kv_heads, head_dim] rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.native import kernels


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    start: int  # first row of the chunk in the flat batch
    end: int
    context_len: int  # cached tokens + this chunk
    context_blocks: torch.Tensor | None  # [num_blocks] int64, None: the chunk is the whole context
    context_slots: torch.Tensor | None  # [context_len] int64
    mask: torch.Tensor | None  # [q_len, context_len] bool, None: plain causal (no cached context)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    slot_blocks: torch.Tensor  # [num_tokens] int64: slot_mapping // block_size
    slot_offsets: torch.Tensor  # [num_tokens] int64: slot_mapping % block_size
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32 (padded with block 0 of the row)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, the new token included
    decode_max_context_len: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_context_len] int64 (gather path only)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context_len] bool (gather path only)
    prefills: tuple[PrefillChunk, ...]
    block_size: int


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One pool for all layers, and each layer's (k_cache, v_cache) views into it."""
    # Never read before written (context lengths bound every read), so no zero-fill.
    pool = torch.empty((num_layers, 2, num_blocks, block_size * num_kv_heads * head_dim), dtype=dtype, device=device)
    views = [
        (
            pool[i, 0].view(num_blocks, num_kv_heads, head_dim, block_size),
            pool[i, 1].view(num_blocks * block_size, num_kv_heads, head_dim),
        )
        for i in range(num_layers)
    ]
    return pool, views


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> None:
    """Store this step's keys and values at their slots (kernels.rope_and_cache does it in C)."""
    k_cache[meta.slot_blocks, :, :, meta.slot_offsets] = k
    v_cache.index_copy_(0, meta.slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every row over its context; this step's k and v must already be in the cache."""
    if not meta.prefills:
        return _decode(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta)
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill(q, k, v, k_cache, v_cache, chunk)
    return out


def _gather_keys(k_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_kv_heads, length, head_dim] keys."""
    blocks = k_cache.index_select(0, block_ids.reshape(-1))  # [n, kv_heads, head_dim, block_size]
    blocks = blocks.view(*block_ids.shape, *k_cache.shape[1:])
    lead = block_ids.dim() - 1
    # [..., n, kv_heads, head_dim, bs] -> [..., kv_heads, n, bs, head_dim]
    order = (*range(lead), lead + 1, lead, lead + 3, lead + 2)
    keys = blocks.permute(order).reshape(*block_ids.shape[:-1], k_cache.shape[1], -1, k_cache.shape[2])
    return keys[..., :length, :]


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    if meta.decode_slots is None:
        return kernels.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.block_size,
            meta.decode_max_context_len,
        )
    b, length = meta.decode_slots.shape
    # By slot, not by whole blocks: a row shorter than the longest must not read the unwritten
    # tail of its last block (whatever the memory held, NaN included: masking does not undo a
    # NaN score). Its padding repeats its first slot.
    slots = meta.decode_slots
    keys = k_cache[slots // meta.block_size, :, :, slots % meta.block_size].transpose(1, 2)  # [b, kv_heads, length, head_dim]
    values = v_cache.index_select(0, slots.view(-1)).view(b, length, *v_cache.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True)
    return out.squeeze(2)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk
) -> torch.Tensor:
    qs = q[chunk.start : chunk.end].transpose(0, 1)  # [num_heads, q_len, head_dim]
    if chunk.context_blocks is None:
        keys = k[chunk.start : chunk.end].transpose(0, 1)
        values = v[chunk.start : chunk.end].transpose(0, 1)
    else:
        keys = _gather_keys(k_cache, chunk.context_blocks, chunk.context_len)
        values = v_cache.index_select(0, chunk.context_slots).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        qs.unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
