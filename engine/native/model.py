"""The decoder forward pass of every served family over a flat batch of prefill chunks and decode tokens.

Plain tensors and functional ops (no nn.Module): the weights come fused from the loader (and,
on CPUs with the compiled kernels, packed for them), the KV cache is owned by the runner and
passed per layer. What differs between families is data in ModelArgs (families.py): norm
placement, q/k norms, activation, multipliers, soft-caps, per-layer window and rope. Numerics
follow `transformers` (RMSNorm, rotate-half RoPE with its own inverse-frequency functions).
On CPUs with the compiled kernels, a decode-only step runs every layer in one C call
(decode_step.c) for every family; Llama-like families also run prefill steps as one compiled
call per operation, the others run them on the general path with the same matmul kernels.
"""

from __future__ import annotations

import dataclasses

import structlog
import torch
import torch.nn.functional as F

from engine.native.attention import AttentionMetadata, AttentionSpec, paged_attention, write_kv_cache
from engine.native.cpu_ops import CpuKernels, DecodeStack, PackedLinear, StackLayer, StackShape
from engine.native.families import Activation, ModelArgs, QKNorm
from engine.native.linear_attention import gated_delta_net
from engine.native.loader import LayerWeights, ModelWeights
from engine.native.quant import Quantization, W4A8Weight, fake_quantize, quantize_activations

log = structlog.get_logger(__name__)


# engine.amx_prefill: a step with at least this many rows runs its decoder matmuls as bf16 on AMX
# tiles (oneDNN through F.linear); measured against our fp32 kernel on a 2-core Sapphire Rapids
# VM (896 -> 9728): even at 8 rows, 2.2x at 32, 5.8x at 512 (bench/RESULTS.md).
AMX_MIN_ROWS = 32


def amx_rows(num_rows: int) -> int:
    """The rows an AMX matmul runs with: `num_rows` rounded up to a multiple of 16 (one tile's
    rows) up to 512, of 128 past it. oneDNN keeps a compiled kernel per shape (~265 KB each, up
    to 1,024 of them): every distinct row count of a step made another, and a server's memory
    grew by hundreds of MB over thousands of requests before the cache filled (measured with
    heaptrack on the 2-core Sapphire Rapids VM). Rounded, a model needs at most ~44 per weight."""
    step = 16 if num_rows <= 512 else 128
    return -(-num_rows // step) * step


def linear(
    x: torch.Tensor, weight: torch.Tensor | PackedLinear | W4A8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(weight, PackedLinear):
        if weight.amx is not None and x.shape[0] >= AMX_MIN_ROWS:
            rows, padded = x.shape[0], x.to(torch.bfloat16)
            if amx_rows(rows) > rows:  # rows are independent: the padding's results are dropped
                padded = F.pad(padded, (0, 0, 0, amx_rows(rows) - rows))
            out = F.linear(padded, weight.amx)[:rows].float()
            return out if bias is None else out.add_(bias)
        return weight.kernels.packed_linear(x, weight, bias)
    if isinstance(weight, W4A8Weight):  # int4 without the kernels: the same rounding of the inputs
        return F.linear(quantize_activations(x), weight.weight, bias)
    return F.linear(x, weight, bias)


class LinearPreparer:
    """Every matmul weight packed for the compiled kernels (cpu given) and quantized as asked,
    one decoder layer at a time as the loader reads them (loader.load_model_weights's `prepare`),
    so that a layer's float32 originals are released before the next is read: the load's peak
    is the prepared model plus one float32 layer, not the whole model in float32 besides (a 7B
    checkpoint served as int8 peaked past 28 GB). Without kernels, int8 or int4 weights are rounded
    and kept as floats (int4: with its inputs rounded as the kernels round them), so every path
    computes the same model.

    The embedding table stays as it is (a lookup, not a matmul); a tied lm_head gets its own
    packed copy of it (`head`). For the fused path (Llama-like layers with kernels), the residual
    multiplier is folded into o_proj and down. `amx` (engine.amx_prefill, kernels and no
    quantization): each decoder layer's packed weight also keeps a bf16 copy for `linear`'s AMX
    path; the lm_head does not (logits stay fp32).
    """

    def __init__(self, cpu: CpuKernels | None, quantization: Quantization, args: ModelArgs, *, amx: bool = False):
        self._cpu, self._quantization, self._amx = cpu, quantization, amx
        # Model runs the fused path on these weights: the residual multiplier folded in.
        self._multiplier = args.residual_multiplier if cpu is not None and args.is_llama_like else 1.0

    def layer(self, layer: LayerWeights) -> LayerWeights:
        if self._multiplier != 1.0:
            layer = dataclasses.replace(
                layer, o_proj=layer.o_proj * self._multiplier, down=layer.down * self._multiplier
            )
        if self._cpu is None and self._quantization is Quantization.NONE:
            return layer
        return dataclasses.replace(
            layer,
            qkv=self._prepare(layer.qkv),
            o_proj=self._prepare(layer.o_proj),
            gate_up=self._prepare(layer.gate_up),
            down=self._prepare(layer.down),
        )

    def head(self, weights: ModelWeights) -> ModelWeights:
        """The lm_head prepared (its layers were, as they were read). int4 keeps the lm_head at
        int8, as llama.cpp's Q4_0 files keep their output matrix wider: the logits are where 4-bit
        rounding costs the most."""
        if self._cpu is None and self._quantization is Quantization.NONE:
            return weights
        quantization = Quantization.INT8 if self._quantization is Quantization.INT4 else self._quantization
        return dataclasses.replace(weights, lm_head=self._prepare(weights.lm_head, quantization, amx=False))

    def _prepare(self, weight, quantization: Quantization | None = None, amx: bool | None = None):
        quantization = self._quantization if quantization is None else quantization
        if self._cpu is not None:
            packed = self._cpu.pack_linear(weight, quantization)
            keep_bf16 = self._amx if amx is None else amx
            return dataclasses.replace(packed, amx=weight.to(torch.bfloat16).contiguous()) if keep_bf16 else packed
        rounded = fake_quantize(weight, quantization)
        return W4A8Weight(rounded) if quantization is Quantization.INT4 else rounded


def rope_inv_freq(args: ModelArgs, key: str, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin scale) for one rope setting, as transformers computes them.

    Length-dependent types are fixed for the engine's whole context, as vLLM does: `dynamic`
    stretches for max_positions beyond max_position_embeddings, and `longrope` uses its long
    factors when max_positions exceeds original_max_position_embeddings.
    """
    rope = args.rope(key)
    dim = args.rotary_dim(key)
    if rope["rope_type"] == "default":
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
        return 1.0 / (float(rope["rope_theta"]) ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    seq_len = max_positions
    if rope["rope_type"] == "dynamic":
        seq_len = max(max_positions, args.max_position_embeddings)
    layer_type = key or None
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](
        args.hf_config, None, seq_len=seq_len, layer_type=layer_type
    )
    return inv_freq.to(torch.float), float(scale)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class Model:
    """cpu: the compiled kernels of the runner's KernelMode (cpu_ops.py): the matmuls run from
    packed weights and the step's small operations as compiled calls; needs fp32 on the CPU and
    weights from LinearPreparer with the same kernels. None: PyTorch ops."""

    def __init__(self, args: ModelArgs, weights: ModelWeights, max_positions: int, *, cpu: CpuKernels | None = None):
        self.args = args
        self.weights = weights
        self.cpu = cpu
        self.packed = cpu is not None
        # Llama-like layers (per-head q/k norms included) run as one compiled call per operation;
        # other families' prefill steps use the general path. Decode-only steps: one C call.
        self.fused_cpu_ops = self.packed and args.is_llama_like
        self.uses_decode_stack = self.packed and args.fits_decode_stack
        # engine.amx_prefill: LinearPreparer gave the packed weights a bf16 copy
        self.amx = bool(weights.layers) and getattr(weights.layers[0].qkv, "amx", None) is not None
        self._stack: DecodeStack | None = None  # built on the first decode-only step
        device, dtype = weights.embed.device, weights.embed.dtype
        self.rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, _ in args.rope_parameters:
            inv_freq, scale = rope_inv_freq(args, key, max_positions)
            freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
            self.rope_tables[key] = ((emb.cos() * scale).to(device, dtype), (emb.sin() * scale).to(device, dtype))
        self.cos, self.sin = self.rope_tables[next(iter(self.rope_tables))]
        self.attention_specs = tuple(
            AttentionSpec(args.attention_scale, layer.sliding_window, args.attn_logit_softcap) for layer in args.layers
        )
        self._embed_scale = torch.tensor(args.embedding_multiplier, dtype=dtype, device=device)
        self._split = (args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache), see attention.py
        meta: AttentionMetadata,
        image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,  # (rows, [len(rows), hidden]) to overwrite
    ) -> torch.Tensor:  # [num_tokens, hidden] residual stream before the final norm
        x = F.embedding(input_ids, self.weights.embed)
        if image_rows is not None:  # image tokens: the vision tower's embeddings replace the lookup
            x.index_copy_(0, image_rows[0], image_rows[1].to(x.dtype))
        if self.args.embedding_multiplier != 1.0:  # after the images, as transformers scales inputs_embeds
            x = x * self._embed_scale
        # Ministral 3 scales queries past its original context: the general path does; the fast
        # paths serve steps whose every position is before it, where the scale is exactly 1.
        query_scale = self.args.query_scale
        unscaled = query_scale is None or (self.packed and int(positions.max()) < query_scale.positions)
        if unscaled and self.uses_decode_stack and not meta.prefills and meta.decode_context_lens is not None:
            return self._decode_stack(kv_caches)(x, positions, meta)  # all in C
        # engine.amx_prefill: a step of many rows also attends in bf16 (as its matmuls run, `linear`)
        attend_dtype = torch.bfloat16 if self.amx and x.shape[0] >= AMX_MIN_ROWS else None
        if unscaled and self.fused_cpu_ops:
            return self._forward_fused(x, positions, kv_caches, meta, attend_dtype)
        q_scales = None
        if query_scale is not None and not unscaled:  # [num_tokens, 1, 1], without a host sync (CUDA graphs)
            steps = torch.floor(positions.to(torch.float32) / query_scale.positions)
            q_scales = (1 + query_scale.beta * torch.log1p(steps)).to(x.dtype)[:, None, None]
        rope = {  # [num_tokens, 1, rotary_dim] each
            key: (cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1))
            for key, (cos, sin) in self.rope_tables.items()
        }
        for i, layer in enumerate(self.weights.layers):
            if layer.linear is not None:  # Qwen3.5's Gated DeltaNet layers: kv_caches[i] holds their state pools
                x = self._linear_attention_layer(layer, x, kv_caches[i], meta)
                continue
            key = self.args.layers[i].rope
            layer_rope = rope.get(key) if key is not None else None
            x = self._layer(i, layer, x, layer_rope, kv_caches[i], meta, attend_dtype, q_scales)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        args = self.args
        if self.packed and self.cpu is not None:  # packed weights come with their kernels
            h = self.cpu.rms_norm(hidden.contiguous(), self.weights.norm, args.rms_norm_eps)
        else:
            h = _rms_norm(hidden, self.weights.norm, args.rms_norm_eps)
        logits = linear(h, self.weights.lm_head)
        if args.logits_divisor != 1.0:
            logits = logits / args.logits_divisor
        if args.final_logit_softcap is not None:
            logits = torch.tanh(logits / args.final_logit_softcap) * args.final_logit_softcap
        return logits

    def _forward_fused(self, x, positions, kv_caches, meta, attend_dtype=None) -> torch.Tensor:
        """The same layers as _layer, as one compiled call per operation.

        The residual add is folded into the next RMSNorm: a layer leaves its MLP output in
        `delta`, and the next layer's first norm adds it to x in place.
        """
        args, eps, cpu = self.args, self.args.rms_norm_eps, self.cpu
        assert cpu is not None  # fused_cpu_ops: compiled kernels are loaded
        num_tokens = x.shape[0]
        q_size, kv_size = self._split
        delta = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.weights.layers, kv_caches, strict=True)):
            assert layer.input_norm is not None and layer.post_norm is not None  # Llama-like: both pre-norms
            h = cpu.rms_norm(x, layer.input_norm, eps, residual=delta)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            if layer.q_norm is not None and layer.k_norm is not None:  # per head, before RoPE (Qwen3)
                qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, args.head_dim)
                qk[:, : args.num_heads] = _rms_norm(qk[:, : args.num_heads], layer.q_norm, eps)
                qk[:, args.num_heads :] = _rms_norm(qk[:, args.num_heads :], layer.k_norm, eps)
            # SmolLM3: some layers without RoPE
            cos, sin = (self.cos, self.sin) if args.layers[i].rope is not None else (None, None)
            cpu.rope_and_cache(qkv, positions, cos, sin, k_cache, v_cache, meta.slot_mapping, args.num_heads)
            q = qkv[:, :q_size].view(num_tokens, args.num_heads, args.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(num_tokens, args.num_kv_heads, args.head_dim)
            v = qkv[:, q_size + kv_size :].view(num_tokens, args.num_kv_heads, args.head_dim)
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.attention_specs[0], attend_dtype)
            h = cpu.rms_norm(x, layer.post_norm, eps, residual=linear(o.reshape(num_tokens, q_size), layer.o_proj))
            delta = linear(cpu.silu_mul(linear(h, layer.gate_up)), layer.down)
        return x.add_(delta) if delta is not None else x

    def _decode_stack(self, kv_caches) -> DecodeStack:
        stack = self._stack
        if stack is None or stack.kv_cache_ptr != kv_caches[0][0].data_ptr():
            assert self.cpu is not None  # uses_decode_stack: compiled kernels are loaded
            a = self.args
            specs = tuple(
                StackLayer(None if spec.rope is None else self.rope_tables[spec.rope], spec.sliding_window, group)
                for spec, group in zip(a.layers, a.kv_groups, strict=True)
            )
            shape = StackShape(
                hidden=a.hidden_size,
                heads=a.num_heads,
                kv_heads=a.num_kv_heads,
                head_dim=a.head_dim,
                intermediate=a.intermediate_size,
                eps=a.rms_norm_eps,
                scale=a.attention_scale,
                softcap=a.attn_logit_softcap,
                gelu_tanh=a.activation is Activation.GELU_TANH,
                qk_norm_whole=a.family.qk_norm is QKNorm.WHOLE,
            )
            stack = self._stack = self.cpu.decode_stack(self.weights.layers, kv_caches, specs, shape)
        return stack

    def _linear_attention_layer(self, layer, x, states, meta) -> torch.Tensor:
        """A Gated DeltaNet layer (linear_attention.py) and its MLP, pre-norms as in Llama."""
        args, eps = self.args, self.args.rms_norm_eps
        assert args.linear_attention is not None and meta.recurrent is not None  # set for these models
        h = _rms_norm(x, layer.input_norm, eps)
        projected = linear(h, layer.qkv)
        mixed = gated_delta_net(args.linear_attention, layer.linear, projected, states, meta.recurrent, eps, self.cpu)
        x = x + linear(mixed, layer.o_proj)
        return x + self._mlp(layer, _rms_norm(x, layer.post_norm, eps))

    def _mlp(self, layer, h) -> torch.Tensor:
        gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
        act = F.silu(gate) if self.args.activation is Activation.SILU else F.gelu(gate, approximate="tanh")
        return linear(act * up, layer.down)

    def _layer(self, i: int, layer, x, rope, kv_cache, meta, attend_dtype=None, q_scales=None) -> torch.Tensor:
        args, eps = self.args, self.args.rms_norm_eps
        num_tokens = x.shape[0]
        h = x if layer.input_norm is None else _rms_norm(x, layer.input_norm, eps)
        q, k, v, gate = self._qkv(layer, h)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if args.family.qk_norm is QKNorm.PER_HEAD_AFTER_ROPE:  # Hunyuan
            q, k = _rms_norm(q, layer.q_norm, eps), _rms_norm(k, layer.k_norm, eps)
        if q_scales is not None:  # Ministral 3, past its original context
            q = q * q_scales
        spec = self.attention_specs[i]
        meta = meta.for_layer(spec)  # a hybrid model's sliding layers: their own KV group
        k_cache, v_cache = kv_cache
        write_kv_cache(k, v, k_cache, v_cache, meta)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, spec, attend_dtype)  # [num_tokens, heads, head_dim]
        o = o.reshape(num_tokens, -1)
        if gate is not None:  # Qwen3.5: a sigmoid gate per output feature
            o = o * torch.sigmoid(gate)
        o = linear(o, layer.o_proj)
        if layer.attn_out_norm is not None:
            o = _rms_norm(o, layer.attn_out_norm, eps)
        x = x + o * args.residual_multiplier if args.residual_multiplier != 1.0 else x + o
        h = x if layer.post_norm is None else _rms_norm(x, layer.post_norm, eps)
        m = self._mlp(layer, h)
        if layer.mlp_out_norm is not None:
            m = _rms_norm(m, layer.mlp_out_norm, eps)
        return x + m * args.residual_multiplier if args.residual_multiplier != 1.0 else x + m

    def _qkv(self, layer, h) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim], q/k normed as the family
        does, and the output gate [tokens, heads * head_dim] (Qwen3.5; else None)."""
        args, eps = self.args, self.args.rms_norm_eps
        q_size, kv_size = self._split
        qkv = linear(h, layer.qkv, layer.qkv_bias)  # [num_tokens, (heads + 2 * kv_heads) * head_dim (+ gate)]
        end = q_size + 2 * kv_size
        q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size : end]
        gate = qkv[:, end:] if qkv.shape[1] > end else None
        if args.family.qk_norm is QKNorm.WHOLE:
            q, k = _rms_norm(q, layer.q_norm, eps), _rms_norm(k, layer.k_norm, eps)
        shape = (h.shape[0], -1, args.head_dim)
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        if args.family.qk_norm is QKNorm.PER_HEAD:
            q, k = _rms_norm(q, layer.q_norm, eps), _rms_norm(k, layer.k_norm, eps)
        return q, k, v, gate


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half form on the first rotary_dim (= cos.shape[-1]) features. x: [num_tokens, heads, head_dim]."""
    dim = cos.shape[-1]
    if dim != x.shape[-1]:  # partial rotary (Phi-3): the rest passes through
        return torch.cat((_rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
