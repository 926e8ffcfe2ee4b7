"""Attention over the paged KV cache for a flat batch of decode tokens and prefill chunks.

Owns the per-step attention metadata and the two paths that read K/V through block tables:
decode rows (one query per sequence) go to the compiled paged-attention kernel when it is
available, else to one padded gather + SDPA; prefill chunks gather their context and run SDPA
with a causal mask aligned to the chunk's position. Rows come decodes first, then chunks.
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
    context_slots: torch.Tensor | None  # [context_len] cache slots, None: the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, context_len] bool, None: plain causal (no cached context)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32 (kernel path)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, the new token included
    decode_max_context_len: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_context_len] int64 (gather path)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context_len] bool (gather path)
    prefills: tuple[PrefillChunk, ...]
    block_size: int


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    nd = meta.num_decode_tokens
    if not meta.prefills:
        return _decode(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta)
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill(q, k, v, k_cache, v_cache, chunk)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    if meta.decode_block_tables is not None:
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
    slots = meta.decode_slots.view(-1)
    # [num_decodes, num_kv_heads, max_context_len, head_dim]
    keys = k_cache.index_select(0, slots).view(b, length, *k_cache.shape[1:]).transpose(1, 2)
    values = v_cache.index_select(0, slots).view(b, length, *v_cache.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True)
    return out.squeeze(2)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk
) -> torch.Tensor:
    qs = q[chunk.start : chunk.end].transpose(0, 1)  # [num_heads, q_len, head_dim]
    if chunk.context_slots is None:
        keys, values = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
    else:
        keys, values = k_cache.index_select(0, chunk.context_slots), v_cache.index_select(0, chunk.context_slots)
    out = F.scaled_dot_product_attention(
        qs.unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
