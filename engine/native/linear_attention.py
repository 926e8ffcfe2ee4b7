"""Gated DeltaNet layers (Qwen3.5's "linear_attention" layers): a recurrent state per sequence
instead of a KV cache.

Each sequence holds, per such layer, the last (kernel - 1) inputs of a causal depthwise
convolution and a [value_heads, key_head_dim, value_head_dim] state matrix S, updated per token
t (q and k L2-normalized, q scaled by key_head_dim ** -0.5, g_t in (0, 1] a per-head decay,
beta_t in (0, 1)):

    S_t = g_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t

Decode rows take one step of it, batched over sequences; a prefill chunk runs it in blocks of
CHUNK tokens in closed form (a triangular solve per block: `_delta_rule_chunk`), starting from
the sequence's state, or from zeros where the chunk starts the sequence. States live in pools
of `num_slots` rows (`RecurrentPools`); state_slots.py hands each running sequence one row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.native.cpu_ops import CpuKernels
from engine.native.families import LinearAttentionShape

CHUNK = 64  # tokens per closed-form block of a prefill chunk


@dataclass(frozen=True, slots=True)
class LinearAttentionWeights:
    """What a Gated DeltaNet layer has besides its two matmuls (LayerWeights.qkv holds the fused
    input projection, LayerWeights.o_proj the output one)."""

    conv_taps: torch.Tensor  # [conv_kernel, conv_dim]: the depthwise convolution (no bias), tap-major
    dt_bias: torch.Tensor  # [value_heads] float32
    neg_a: torch.Tensor  # [value_heads] float32: -exp(A_log)
    norm: torch.Tensor  # [value_head_dim]: the gated RMSNorm's weight (plain, no 1 + w)


@dataclass(frozen=True, slots=True)
class RecurrentBatch:
    """Which state row each row of a step reads and writes. Decode rows come first, one per
    sequence; then each prefill chunk: (state row, first row, number of rows, starts the sequence).
    A one-token chunk sits among the decode rows: where it is at position 0 (a one-token prompt,
    or a prompt's first chunk cut to one token by the step's budget) its row is in `fresh_slots`,
    zeroed before the step reads it."""

    decode_slots: torch.Tensor  # [num_decodes] int64
    chunks: tuple[tuple[int, int, int, bool], ...]
    fresh_slots: torch.Tensor | None = None  # [num_fresh] int64, of decode_slots; None: no such row


class RecurrentPools:
    """Per Gated DeltaNet layer, the convolution and delta-rule states of `num_slots` sequences."""

    def __init__(self, shape: LinearAttentionShape, num_layers: int, num_slots: int, device: torch.device):
        self.shape = shape
        kernel = shape.conv_kernel - 1
        state = (num_slots, shape.value_heads, shape.key_head_dim, shape.value_head_dim)
        # Never read before written: a chunk that starts a sequence starts from zeros.
        self.layers = [
            (
                torch.empty(num_slots, kernel, shape.conv_dim, device=device),  # oldest input first
                torch.empty(state, device=device),
            )
            for _ in range(num_layers)
        ]

    @staticmethod
    def bytes_per_slot(shape: LinearAttentionShape, num_layers: int) -> int:
        return shape.state_bytes() * num_layers


def gated_delta_net(
    shape: LinearAttentionShape,
    weights: LinearAttentionWeights,
    projected: torch.Tensor,  # [num_tokens, in_proj_rows]: the layer's input through in_proj
    states: tuple[torch.Tensor, torch.Tensor],  # this layer's (conv, delta-rule) pools
    batch: RecurrentBatch,
    eps: float,
    cpu: CpuKernels | None = None,  # the compiled kernels: decode rows' states updated in place (gated_delta.c)
) -> torch.Tensor:  # [num_tokens, value_dim], ready for out_proj
    s = shape
    mixed, z, b, a = projected.split([s.conv_dim, s.value_dim, s.value_heads, s.value_heads], dim=-1)
    beta = torch.sigmoid(b.float())  # [num_tokens, value_heads]
    log_decay = weights.neg_a * F.softplus(a.float() + weights.dt_bias)  # log g, <= 0
    conv_pool, delta_pool = states
    out = torch.empty(projected.shape[0], s.value_heads, s.value_head_dim, dtype=torch.float32, device=projected.device)
    num_decodes = batch.decode_slots.shape[0]
    if num_decodes:
        rows = slice(0, num_decodes)
        slots = batch.decode_slots
        if batch.fresh_slots is not None:
            conv_pool.index_fill_(0, batch.fresh_slots, 0.0)
            delta_pool.index_fill_(0, batch.fresh_slots, 0.0)
        # [n, kernel, conv_dim]: the last kernel - 1 inputs and this one
        window = torch.cat((conv_pool.index_select(0, slots), mixed[rows, None, :].float()), dim=1)
        conv_pool.index_copy_(0, slots, window[:, 1:])
        x = F.silu((window * weights.conv_taps).sum(1))
        q, k, v = _heads(s, x)
        if cpu is not None:
            out[rows] = cpu.gated_delta_decode(delta_pool, slots, q, k, v, beta[rows], log_decay[rows])
        else:
            state, o = _delta_rule_step(delta_pool.index_select(0, slots), q, k, v, beta[rows], log_decay[rows])
            delta_pool.index_copy_(0, slots, state)
            out[rows] = o
    for slot, first, num_rows, starts in batch.chunks:
        rows = slice(first, first + num_rows)
        history = conv_pool[slot].new_zeros(conv_pool.shape[1:]) if starts else conv_pool[slot]
        padded = torch.cat((history, mixed[rows].float()))  # [kernel - 1 + num_rows, conv_dim]
        conv_pool[slot] = padded[-(s.conv_kernel - 1) :]
        # The causal depthwise convolution as one multiply-add per tap over the time-major rows
        # (conv1d wants channels first: two transposed copies and strided work after it)
        x = padded[s.conv_kernel - 1 :] * weights.conv_taps[-1]
        for tap in range(s.conv_kernel - 1):
            x.addcmul_(padded[tap : tap + num_rows], weights.conv_taps[tap])
        q, k, v = _heads(s, F.silu(x, inplace=True))
        state = delta_pool.new_zeros(delta_pool.shape[1:]) if starts else delta_pool[slot]
        state, o = _delta_rule_prefill(state, q, k, v, beta[rows], log_decay[rows])
        delta_pool[slot] = state
        out[rows] = o
    gate = z.float().view(-1, s.value_heads, s.value_head_dim)
    normed = F.rms_norm(out, (s.value_head_dim,), weights.norm.float(), eps) * F.silu(gate)
    return normed.reshape(projected.shape[0], s.value_dim).to(projected.dtype)


def _heads(s: LinearAttentionShape, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [tokens, value_heads, key_head_dim] (normalized, each key head shared by its group of
    value heads), v [tokens, value_heads, value_head_dim], from the convolution's output."""
    q, k, v = x.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
    n, group = x.shape[0], s.value_heads // s.key_heads
    q = F.normalize(q.view(n, s.key_heads, s.key_head_dim), dim=-1, eps=1e-6) * s.key_head_dim**-0.5
    k = F.normalize(k.view(n, s.key_heads, s.key_head_dim), dim=-1, eps=1e-6)
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q, k, v.view(n, s.value_heads, s.value_head_dim)


def _delta_rule_step(
    state: torch.Tensor,  # [n, heads, dk, dv], a copy: updated in place and returned
    q: torch.Tensor,  # [n, heads, dk]
    k: torch.Tensor,
    v: torch.Tensor,  # [n, heads, dv]
    beta: torch.Tensor,  # [n, heads]
    log_decay: torch.Tensor,  # [n, heads]
) -> tuple[torch.Tensor, torch.Tensor]:
    n, heads, dk, dv = state.shape
    decay = log_decay.exp()[..., None]  # [n, heads, 1]
    remembered = (k[..., None, :] @ state).squeeze(-2) * decay  # [n, heads, dv]: (g S)^T k
    delta = (v - remembered) * beta[..., None]
    state.mul_(decay[..., None])
    state.view(n * heads, dk, dv).baddbmm_(k.reshape(n * heads, dk, 1), delta.reshape(n * heads, 1, dv))
    return state, (q[..., None, :] @ state).squeeze(-2)


def _delta_rule_prefill(
    state: torch.Tensor,  # [heads, dk, dv]
    q: torch.Tensor,  # [tokens, heads, dk]
    k: torch.Tensor,
    v: torch.Tensor,  # [tokens, heads, dv]
    beta: torch.Tensor,  # [tokens, heads]
    log_decay: torch.Tensor,  # [tokens, heads]
) -> tuple[torch.Tensor, torch.Tensor]:  # final state, outputs [tokens, heads, dv]
    # head-major once: [heads, tokens, d]; each block is then a view with contiguous rows
    q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    beta, log_decay = beta.t().contiguous(), log_decay.t().contiguous()
    outputs = []
    for start in range(0, q.shape[1], CHUNK):
        block = slice(start, start + CHUNK)
        state, o = _delta_rule_chunk(state, q[:, block], k[:, block], v[:, block], beta[:, block], log_decay[:, block])
        outputs.append(o)
    return state, torch.cat(outputs, dim=1).transpose(0, 1)


def _delta_rule_chunk(
    state: torch.Tensor,  # [heads, dk, dv]: S_0, before the block
    q: torch.Tensor,  # [heads, c, dk]
    k: torch.Tensor,
    v: torch.Tensor,  # [heads, c, dv]
    beta: torch.Tensor,  # [heads, c]
    log_decay: torch.Tensor,  # [heads, c]
) -> tuple[torch.Tensor, torch.Tensor]:
    """c steps of the recurrence at once. With G_t the running sum of log g within the block,
    the update each token writes, d_t = beta_t (v_t - g_t S_{t-1}^T k_t), satisfies

        d_t + beta_t sum_{i<t} e^(G_t - G_i) (k_t . k_i) d_i = beta_t (v_t - e^(G_t) S_0^T k_t)

    a unit lower-triangular system; then o_t = e^(G_t) S_0^T q_t + sum_{i<=t} e^(G_t - G_i) (q_t . k_i) d_i
    and S_c = e^(G_c) S_0 + sum_i e^(G_c - G_i) k_i d_i^T."""
    c = q.shape[1]
    cum = log_decay.cumsum(-1)  # [heads, c]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # e^(G_t - G_i) for i <= t; masked before exp so that i > t cannot overflow
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [heads, c, c]
    strict = decay.masked_fill(torch.eye(c, dtype=torch.bool, device=q.device), 0.0)
    system = beta[:, :, None] * strict * (k @ k.transpose(1, 2))
    system = system + torch.eye(c, device=q.device)
    rhs = beta[:, :, None] * (v - cum.exp()[:, :, None] * (k @ state))
    delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [heads, c, dv]
    o = cum.exp()[:, :, None] * (q @ state) + (decay * (q @ k.transpose(1, 2))) @ delta
    tail = (cum[:, -1:] - cum).exp()  # [heads, c]: e^(G_c - G_i)
    state = cum[:, -1].exp()[:, None, None] * state + (k * tail[:, :, None]).transpose(1, 2) @ delta
    return state, o
