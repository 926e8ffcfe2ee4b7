"""Attention over the paged KV cache for a flat batch of decode tokens and prefill chunks.

Owns the cache layout, the per-step attention metadata and the two paths that read K/V
through block tables: decode rows (one query per sequence) go to the compiled kernel when the
runner put one in the metadata (CpuKernels.paged_decode_attention), else to one padded gather
+ SDPA; prefill chunks gather their context and run SDPA with a causal mask aligned to the
chunk's position. Rows come decodes first, then chunks.

Each KV group (block_manager.py) has its own pool; all pools share one buffer.
Layout per layer: K blocks transposed, [num_blocks, num_kv_heads, head_dim, block_size], so the
kernel scores 16 tokens per vector op; V as [num_slots, num_kv_heads, head_dim] rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.native.linear_attention import RecurrentBatch


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """How one layer attends: its q.k scale, its sliding window and its logit soft-cap."""

    scale: float
    sliding_window: int | None = None  # the last `sliding_window` positions, this one included
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    start: int  # first row of the chunk in the flat batch
    end: int
    context_len: int  # cached tokens + this chunk
    context_blocks: torch.Tensor | None  # [num_blocks] int64, None: the chunk is the whole context
    context_slots: torch.Tensor | None  # [context_len] int64
    mask: torch.Tensor | None  # [q_len, context_len] bool, None: plain causal (no cached context)
    window_mask: torch.Tensor | None = None  # [q_len, context_len] bool for sliding layers (None: no such layer)
    gather_keys_by_slot: bool = False  # some context blocks were released: read keys slot by slot


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    slot_blocks: torch.Tensor  # [num_tokens] int64: slot_mapping // block_size
    slot_offsets: torch.Tensor  # [num_tokens] int64: slot_mapping % block_size
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32 (padded with block 0 of the row)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, the new token included (kernel path only)
    decode_max_context_len: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_context_len] int64 (gather path only)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context_len] bool (gather path only)
    prefills: tuple[PrefillChunk, ...]
    block_size: int
    decode_window_mask: torch.Tensor | None = None  # like decode_mask, for sliding layers
    decode_kernel: Callable | None = None  # CpuKernels.paged_decode_attention (kernel path only)
    # A model mixing sliding and global layers: the sliding layers' KV group (its own blocks,
    # slots and masks); this object's fields are then the global layers'.
    window_group: AttentionMetadata | None = None
    # A model with Gated DeltaNet layers (Qwen3.5): each row's recurrent-state row (linear_attention.py)
    recurrent: RecurrentBatch | None = None

    def for_layer(self, spec: AttentionSpec) -> AttentionMetadata:
        return self.window_group if spec.sliding_window is not None and self.window_group is not None else self


def allocate_kv_cache(
    layer_groups: tuple[int, ...],
    group_num_blocks: tuple[int, ...],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    device,
) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """One buffer holding every KV group's pool (group g: group_num_blocks[g] blocks of each of
    its layers; layer_groups[i] is layer i's group), each group's pool as [its layers, 2 (K, V),
    blocks, block elements], and each layer's (k_cache, v_cache) views."""
    block_numel = block_size * num_kv_heads * head_dim
    num_layers = [layer_groups.count(g) for g in range(len(group_num_blocks))]
    sizes = [n * 2 * blocks * block_numel for n, blocks in zip(num_layers, group_num_blocks, strict=True)]
    # Never read before written (context lengths bound every read), so no zero-fill.
    buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
    parts = zip(buffer.split(sizes), num_layers, group_num_blocks, strict=True)
    pools = [part.view(n, 2, blocks, block_numel) for part, n, blocks in parts]
    views, next_index = [], [0] * len(pools)
    for g in layer_groups:
        layer, num_blocks = pools[g][next_index[g]], group_num_blocks[g]
        next_index[g] += 1
        views.append(
            (
                layer[0].view(num_blocks, num_kv_heads, head_dim, block_size),
                layer[1].view(num_blocks * block_size, num_kv_heads, head_dim),
            )
        )
    return buffer, pools, views


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
    spec: AttentionSpec | None = None,  # None: Llama's (head_dim ** -0.5, whole context)
    prefill_dtype: torch.dtype | None = None,  # engine.amx_prefill: prompt chunks attend in bf16
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every row over its context; this step's k and v must already be in the cache."""
    spec = spec or AttentionSpec(q.shape[-1] ** -0.5)
    if not meta.prefills:
        return _decode(q, k_cache, v_cache, meta, spec)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, spec)
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill(q, k, v, k_cache, v_cache, chunk, spec, prefill_dtype)
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


def _attend(q, keys, values, mask, spec: AttentionSpec) -> torch.Tensor:
    """SDPA over [batch, heads, len, head_dim]; with a soft-cap, the same steps as transformers' eager path."""
    if spec.softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, scale=spec.scale, enable_gqa=True
        )
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * spec.scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
    if meta.decode_kernel is not None:
        return meta.decode_kernel(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.decode_max_context_len,
            scale=spec.scale,
            sliding_window=spec.sliding_window,
            softcap=spec.softcap,
        )
    assert meta.decode_slots is not None  # built whenever the kernel does not run this step
    b, length = meta.decode_slots.shape
    # By slot, not by whole blocks: a row shorter than the longest must not read the unwritten
    # tail of its last block (whatever the memory held, NaN included: masking does not undo a
    # NaN score). Its padding repeats its first slot.
    slots = meta.decode_slots
    keys = k_cache[slots // meta.block_size, :, :, slots % meta.block_size].transpose(
        1, 2
    )  # [b, kv_heads, length, head_dim]
    values = v_cache.index_select(0, slots.view(-1)).view(b, length, *v_cache.shape[1:]).transpose(1, 2)
    mask = meta.decode_window_mask if spec.sliding_window is not None else meta.decode_mask
    return _attend(q.unsqueeze(2), keys, values, mask, spec).squeeze(2)


def _prefill(
    q, k, v, k_cache, v_cache, chunk: PrefillChunk, spec: AttentionSpec, dtype: torch.dtype | None = None
) -> torch.Tensor:
    qs = q[chunk.start : chunk.end].transpose(0, 1)  # [num_heads, q_len, head_dim]
    if chunk.context_blocks is None:
        keys = k[chunk.start : chunk.end].transpose(0, 1)
        values = v[chunk.start : chunk.end].transpose(0, 1)
    elif chunk.gather_keys_by_slot:  # [context_len, kv_heads, head_dim] -> [kv_heads, context_len, head_dim]
        slots, block_size = chunk.context_slots, k_cache.shape[-1]
        keys = k_cache[slots // block_size, :, :, slots % block_size].transpose(0, 1)
        values = v_cache.index_select(0, slots).transpose(0, 1)
    else:
        keys = _gather_keys(k_cache, chunk.context_blocks, chunk.context_len)
        values = v_cache.index_select(0, chunk.context_slots).transpose(0, 1)
    mask = chunk.window_mask if spec.sliding_window is not None else chunk.mask
    q_len = qs.shape[1]
    if dtype is not None:  # bf16 on AMX: SDPA's flash kernel uses the tiles, softmax sums stay fp32
        qs, keys, values, mask = padded_for_amx(qs.to(dtype), keys.to(dtype), values.to(dtype), mask)
    out = _attend(qs.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask, spec)
    return out[0, :, :q_len].transpose(0, 1).to(q.dtype)


AMX_ATTENTION_ROWS = 16  # queries and keys of a bf16 prefill chunk are padded to a multiple of this


def padded_for_amx(
    qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A bf16 chunk's queries, keys and values ([heads, len, head_dim]) with zero rows appended up
    to multiples of AMX_ATTENTION_ROWS, and its mask ([q_len, context_len], None: causal over
    equal lengths) grown to match: padded keys are masked out of every real query, padded queries
    (their outputs dropped) see the first key. PyTorch's bf16 flash kernel compiles and keeps a
    small GEMM per block shape, with no bound: every new (chunk length, context length) pair left
    one more, and a server's memory grew by hundreds of MB over thousands of prompts. 3,000 random
    chunks (32-512 queries, up to 2,048 more keys of context) left +1,305 MB, still growing;
    padded, +73 MB, flat after the first 1,000 (14 heads, 2 KV heads, torch 2.13, the 2-core
    Sapphire Rapids VM). Padding changes bf16 rounding only, as amx_rows does for the matmuls."""
    q_len, kv_len = qs.shape[1], keys.shape[1]
    pq, pk = (-(-n // AMX_ATTENTION_ROWS) * AMX_ATTENTION_ROWS for n in (q_len, kv_len))
    if (pq, pk) == (q_len, kv_len):
        return qs, keys, values, mask
    qs, keys, values = (F.pad(t, (0, 0, 0, n - t.shape[1])) for t, n in ((qs, pq), (keys, pk), (values, pk)))
    if mask is None and q_len == kv_len:  # causal over the padded square still hides padded keys from real queries
        return qs, keys, values, None
    grown = torch.zeros(pq, pk, dtype=torch.bool, device=qs.device)
    if mask is None:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=qs.device).tril()
    grown[:q_len, :kv_len] = mask
    grown[q_len:, 0] = True  # a query that sees no key would give NaN
    return qs, keys, values, grown
