"""The Llama forward pass over a flat batch that mixes prefill chunks and decode tokens.

Plain tensors and functional ops (no nn.Module): the weights come fused from the loader (and,
on CPUs with the compiled kernels, packed for them), the KV cache is owned by the runner and
passed per layer. Numerics follow `transformers`' Llama
(RMSNorm, rotate-half RoPE with the same inverse frequencies, SiLU-gated MLP).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from engine.native import kernels
from engine.native.attention import AttentionMetadata, paged_attention, write_kv_cache
from engine.native.kernels import PackedLinear
from engine.native.loader import LlamaArgs, LlamaWeights


def linear(x: torch.Tensor, weight: torch.Tensor | PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, PackedLinear):
        return kernels.packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def pack_linear_layers(weights: LlamaWeights) -> LlamaWeights:
    """Every matmul weight packed for the compiled kernel; the originals are released.

    The embedding table stays as it is (a lookup, not a matmul); a tied lm_head gets its own
    packed copy of it.
    """
    layers = tuple(
        dataclasses.replace(
            layer,
            qkv=kernels.pack_linear(layer.qkv),
            o_proj=kernels.pack_linear(layer.o_proj),
            gate_up=kernels.pack_linear(layer.gate_up),
            down=kernels.pack_linear(layer.down),
        )
        for layer in weights.layers
    )
    return dataclasses.replace(weights, layers=layers, lm_head=kernels.pack_linear(weights.lm_head))


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies exactly as transformers computes them (default, linear, llama3)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    scaling = dict(args.rope_scaling)
    if args.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if args.rope_type != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class Llama:
    """fused_cpu_ops: run the step's small operations as the compiled kernels (kernels.py) and the
    matmuls from packed weights; needs fp32 on the CPU and weights from pack_linear_layers."""

    def __init__(self, args: LlamaArgs, weights: LlamaWeights, max_positions: int, *, fused_cpu_ops: bool = False):
        self.args = args
        self.weights = weights
        self.fused_cpu_ops = fused_cpu_ops
        self._stack: kernels.DecodeStack | None = None  # built on the first decode-only step
        device, dtype = weights.embed.device, weights.embed.dtype
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * rope_inv_freq(args)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self._split = (args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache), see attention.py
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] residual stream before the final norm
        x = F.embedding(input_ids, self.weights.embed)
        if self.fused_cpu_ops:
            return self._forward_fused(x, positions, kv_caches, meta)
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        for i, layer in enumerate(self.weights.layers):
            x = self._layer(layer, x, cos, sin, kv_caches[i], meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        if self.fused_cpu_ops:
            h = kernels.rms_norm(hidden, self.weights.norm, self.args.rms_norm_eps)
        else:
            h = F.rms_norm(hidden, (self.args.hidden_size,), self.weights.norm, self.args.rms_norm_eps)
        return linear(h, self.weights.lm_head)

    def _forward_fused(self, x, positions, kv_caches, meta) -> torch.Tensor:
        """The same layers as _layer, as one compiled call per operation.

        The residual add is folded into the next RMSNorm: a layer leaves its MLP output in
        `delta`, and the next layer's first norm adds it to x in place.
        """
        if not meta.prefills and meta.decode_block_tables is not None:  # every row a decode: all in C
            stack = self._decode_stack(kv_caches)
            return stack(x, positions, meta.slot_mapping, self.cos, self.sin, meta.decode_block_tables,
                         meta.decode_context_lens, meta.decode_max_context_len)
        args, eps = self.args, self.args.rms_norm_eps
        num_tokens = x.shape[0]
        q_size, kv_size = self._split
        delta = None
        for layer, (k_cache, v_cache) in zip(self.weights.layers, kv_caches, strict=True):
            h = kernels.rms_norm(x, layer.input_norm, eps, residual=delta)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            kernels.rope_and_cache(qkv, positions, self.cos, self.sin, k_cache, v_cache, meta.slot_mapping, args.num_heads)
            q = qkv[:, :q_size].view(num_tokens, args.num_heads, args.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(num_tokens, args.num_kv_heads, args.head_dim)
            v = qkv[:, q_size + kv_size :].view(num_tokens, args.num_kv_heads, args.head_dim)
            o = paged_attention(q, k, v, k_cache, v_cache, meta)
            h = kernels.rms_norm(x, layer.post_norm, eps, residual=linear(o.reshape(num_tokens, q_size), layer.o_proj))
            delta = linear(kernels.silu_mul(linear(h, layer.gate_up)), layer.down)
        return x.add_(delta) if delta is not None else x

    def _decode_stack(self, kv_caches) -> kernels.DecodeStack:
        stack = self._stack
        if stack is None or stack.kv_cache_ptr != kv_caches[0][0].data_ptr():
            a = self.args
            stack = self._stack = kernels.DecodeStack(
                self.weights.layers, kv_caches, hidden=a.hidden_size, heads=a.num_heads, kv_heads=a.num_kv_heads,
                head_dim=a.head_dim, intermediate=a.intermediate_size, eps=a.rms_norm_eps,
            )
        return stack

    def _layer(self, layer, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        args = self.args
        num_tokens = x.shape[0]
        h = F.rms_norm(x, (args.hidden_size,), layer.input_norm, args.rms_norm_eps)
        qkv = linear(h, layer.qkv, layer.qkv_bias)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q_size, kv_size = self._split
        # q and k sit side by side in qkv: rotate both with one set of ops.
        qk = _rotate(qkv[:, : q_size + kv_size].view(num_tokens, -1, args.head_dim), cos, sin)
        q, k = qk[:, : args.num_heads], qk[:, args.num_heads :]
        v = qkv[:, q_size + kv_size :].view(num_tokens, args.num_kv_heads, args.head_dim)
        write_kv_cache(k, v, *kv_cache, meta)
        o = paged_attention(q, k, v, *kv_cache, meta)  # [num_tokens, heads, head_dim]
        x = x + linear(o.reshape(num_tokens, q_size), layer.o_proj)
        h = F.rms_norm(x, (args.hidden_size,), layer.post_norm, args.rms_norm_eps)
        gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, layer.down)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half form: x * cos + rotate_half(x) * sin. x: [num_tokens, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
