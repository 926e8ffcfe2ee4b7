"""What differs between the model families the native engine serves, as data.

Each family is one `Family` row (weight layout and the few structural switches); every number
(head_dim, multipliers, soft-caps, sliding windows, rope settings per layer) is read from the
checkpoint's config through `transformers`' own config class, so defaults and the config.json
layouts of every transformers version are resolved exactly as transformers resolves them.
It never touches weights or tensors (model.py runs what ModelArgs describes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Norms(Enum):
    """Where a decoder layer's RMSNorms sit (and what the checkpoint calls them: loader.NORM_NAMES)."""

    PRE = "pre"  # Llama: norm -> attention -> add; norm -> MLP -> add
    SANDWICH = "sandwich"  # Gemma 2/3: pre and post norm around both attention and MLP
    SANDWICH_GLM4 = "sandwich_glm4"  # GLM-4: Gemma's, under other names
    POST = "post"  # OLMo 2: attention -> norm -> add; MLP -> norm -> add


class QKNorm(Enum):
    NONE = "none"
    PER_HEAD = "per_head"  # Qwen3, Gemma 3: RMSNorm over each head's head_dim
    WHOLE = "whole"  # OLMo 2: RMSNorm over the whole q (and k) projection
    PER_HEAD_AFTER_ROPE = "per_head_after_rope"  # Hunyuan: the same, on q and k after rope


class Activation(Enum):
    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"


_ACTIVATIONS = {"silu": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu_tanh": Activation.GELU_TANH}


@dataclass(frozen=True, slots=True)
class Family:
    norms: Norms = Norms.PRE
    qk_norm: QKNorm = QKNorm.NONE
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + weight)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    fused_qkv: bool = False  # Phi-3: qkv_proj in the checkpoint
    fused_gate_up: bool = False  # Phi-3, GLM-4: gate_up_proj in the checkpoint
    # EXAONE 4: where sliding layers mix with global ones, the global layers use no rope
    global_layers_without_rope: bool = False
    # Qwen3.5: Gated DeltaNet layers where layer_types says "linear_attention" (linear_attention.py),
    # and q_proj doubles as a sigmoid gate on each attention head's output
    linear_attention: bool = False
    # ERNIE 4.5, GLM-4: rope rotates feature pairs (2i, 2i + 1), not (i, i + rotary_dim / 2); the loader
    # reorders q's and k's rows so that the engine's rotate-half rope computes it (a q/k norm's
    # weight would need the same order: no such family has one)
    interleaved_rope: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "ministral": Family(),  # Ministral 8B: Mistral's, its sliding window on the layers layer_types names
    "ministral3": Family(),  # Ministral 3: Mistral's, with queries scaled past the original context (QueryScale)
    "qwen2": Family(),
    "qwen3": Family(qk_norm=QKNorm.PER_HEAD),
    "smollm3": Family(),
    "granite": Family(),
    "ernie4_5": Family(interleaved_rope=True),  # ERNIE 4.5 dense: Llama's layers, interleaved rope
    "olmo2": Family(norms=Norms.POST, qk_norm=QKNorm.WHOLE),
    "exaone4": Family(norms=Norms.POST, qk_norm=QKNorm.PER_HEAD, global_layers_without_rope=True),
    "olmo3": Family(norms=Norms.POST, qk_norm=QKNorm.WHOLE),  # OLMo 2's, with sliding layers and their own rope
    "phi3": Family(fused_qkv=True, fused_gate_up=True),
    "gemma2": Family(norms=Norms.SANDWICH, norm_offset=1.0, scale_embeddings=True),
    "gemma3_text": Family(norms=Norms.SANDWICH, qk_norm=QKNorm.PER_HEAD, norm_offset=1.0, scale_embeddings=True),
    "qwen3_5_text": Family(qk_norm=QKNorm.PER_HEAD, norm_offset=1.0, linear_attention=True),
    # Hunyuan dense (0.5B-7B): q/k norms after rope, named query_layernorm / key_layernorm
    "hunyuan_v1_dense": Family(qk_norm=QKNorm.PER_HEAD_AFTER_ROPE),
    "glm4": Family(norms=Norms.SANDWICH_GLM4, fused_gate_up=True, interleaved_rope=True),  # GLM-4 0414, GLM-Z1
}
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class LinearAttentionShape:
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # q, k and v go through the convolution
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_rows(self) -> int:  # [q k v | z | b | a] fused into one matmul
        return self.conv_dim + self.value_dim + 2 * self.value_heads

    def state_bytes(self) -> int:
        """One sequence's state in one layer (float32)."""
        conv = self.conv_dim * (self.conv_kernel - 1)
        return 4 * (conv + self.value_heads * self.key_head_dim * self.value_head_dim)


class UnsupportedConfig(ValueError):
    """The config asks for something the engine does not implement; the message names it."""


@dataclass(frozen=True, slots=True)
class QueryScale:
    """Queries at position p multiplied by 1 + beta * log(1 + floor(p / positions)) after rope
    (rope_parameters' llama_4_scaling_beta and original_max_position_embeddings): exactly 1
    before `positions`, so the engine's fast paths serve those positions as they are."""

    beta: float
    positions: int


@dataclass(frozen=True, slots=True)
class LayerSpec:
    sliding_window: int | None  # attend to the last `sliding_window` positions (this one included)
    rope: str | None  # key into ModelArgs.rope_parameters; None: this layer has no rotary embedding
    linear: bool = False  # a Gated DeltaNet layer (no attention, no KV cache)


@dataclass(frozen=True, slots=True)
class ModelArgs:
    model_type: str
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    activation: Activation
    layers: tuple[LayerSpec, ...]
    rope_parameters: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]  # per rope key, sorted items
    attention_scale: float  # multiplies q.k (head_dim ** -0.5 unless the family sets it)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0  # Granite's logits_scaling
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_scale: QueryScale | None = None  # Ministral 3 (Llama 4's attention temperature)
    linear_attention: LinearAttentionShape | None = None  # Qwen3.5's Gated DeltaNet layers
    hf_config: Any = field(default=None, compare=False, repr=False)  # for transformers' rope functions

    @property
    def rope_type(self) -> str:
        return self.rope(self.layers[0].rope or next(iter(dict(self.rope_parameters)), ""))["rope_type"]

    @property
    def rope_theta(self) -> float:
        return float(self.rope(self.layers[0].rope or next(iter(dict(self.rope_parameters)), ""))["rope_theta"])

    def rope(self, key: str) -> dict[str, Any]:
        return dict(dict(self.rope_parameters)[key])

    @property
    def sliding_window(self) -> int | None:
        """The one window size of the sliding layers (None: every layer attends to everything)."""
        windows = {layer.sliding_window for layer in self.layers} - {None}
        return windows.pop() if windows else None

    @property
    def is_llama_like(self) -> bool:
        """Runs through the fused CPU layer path: Llama's layer plus, at most, per-head q/k norms,
        layers without RoPE (SmolLM3), and Granite's attention and residual multipliers."""
        f = self.family
        ropes = {layer.rope for layer in self.layers} - {None}
        (rope,) = ropes if len(ropes) == 1 else (None,)
        return (
            f.norms is Norms.PRE
            and not f.linear_attention
            and f.qk_norm in (QKNorm.NONE, QKNorm.PER_HEAD)
            and self.activation is Activation.SILU
            and rope is not None
            and self.rotary_dim(rope) == self.head_dim
            and self.sliding_window is None
            and self.attn_logit_softcap is None
        )

    @property
    def fits_decode_stack(self) -> bool:
        """decode_step.c runs every layer of a decode-only step: every family's layer (norm
        placement, q/k norms, partial and per-layer RoPE, windows, soft-caps, GELU-tanh) fits, and
        a residual multiplier where it is folded into the weights (Llama-like layers, Granite)."""
        f = self.family
        if f.linear_attention or f.qk_norm is QKNorm.PER_HEAD_AFTER_ROPE:  # the C step norms q/k before rope
            return False
        return self.residual_multiplier == 1.0 or self.is_llama_like

    @property
    def kv_groups(self) -> tuple[int, ...]:
        """Each layer's KV group (block_manager.py): 0 for all, unless sliding layers mix with
        global ones; then the global layers are group 0 and the sliding ones group 1."""
        hybrid = len({layer.sliding_window for layer in self.layers}) == 2
        return tuple(int(hybrid and layer.sliding_window is not None) for layer in self.layers)

    def rotary_dim(self, key: str) -> int:
        return int(self.head_dim * float(self.rope(key).get("partial_rotary_factor", 1.0)))

    @property
    def num_parameters(self) -> int:
        """Parameters of the matmuls a token passes through (embedding lookup excluded)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        lm_head = self.vocab_size * self.hidden_size
        linear = self.linear_attention
        if linear is None:
            return self.num_layers * (attn + mlp) + lm_head
        num_linear = self.num_linear_layers
        linear_params = self.hidden_size * (linear.in_proj_rows + linear.value_dim)
        attn += self.hidden_size * self.num_heads * self.head_dim  # the output gate
        return num_linear * linear_params + (self.num_layers - num_linear) * attn + self.num_layers * mlp + lm_head

    @property
    def num_linear_layers(self) -> int:
        return sum(layer.linear for layer in self.layers)

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache."""
        return self.num_layers - self.num_linear_layers


def model_args_from_config(config: Any) -> ModelArgs:
    """ModelArgs from a transformers config object; UnsupportedConfig names what is missing."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise UnsupportedConfig(f"model_type {config.model_type!r} is not one of {', '.join(FAMILIES)}")
    act_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act_name not in _ACTIVATIONS:
        raise UnsupportedConfig(f"hidden_act {act_name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    num_heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    rope_params = _rope_parameters(config)
    layers = _layer_specs(config, rope_params, family)
    if len({layer.sliding_window for layer in layers} - {None}) > 1:
        raise UnsupportedConfig("sliding layers with different window sizes are not supported")
    pre_attn = getattr(config, "query_pre_attn_scalar", None)
    scale = float(getattr(config, "attention_multiplier", None) or (pre_attn or head_dim) ** -0.5)
    return ModelArgs(
        model_type=config.model_type,
        family=family,
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        activation=_ACTIVATIONS[act_name],
        layers=layers,
        rope_parameters=tuple((k, tuple(sorted(v.items()))) for k, v in rope_params.items()),
        attention_scale=scale,
        query_scale=_query_scale(rope_params),
        linear_attention=_linear_attention_shape(config) if family.linear_attention else None,
        embedding_multiplier=_embedding_multiplier(config, family),
        residual_multiplier=float(getattr(config, "residual_multiplier", 1.0) or 1.0),
        logits_divisor=float(getattr(config, "logits_scaling", 1.0) or 1.0),
        attn_logit_softcap=_optional_float(getattr(config, "attn_logit_softcapping", None)),
        final_logit_softcap=_optional_float(getattr(config, "final_logit_softcapping", None)),
        hf_config=config,
    )


def _linear_attention_shape(config: Any) -> LinearAttentionShape:
    shape = LinearAttentionShape(
        key_heads=int(config.linear_num_key_heads),
        value_heads=int(config.linear_num_value_heads),
        key_head_dim=int(config.linear_key_head_dim),
        value_head_dim=int(config.linear_value_head_dim),
        conv_kernel=int(config.linear_conv_kernel_dim),
    )
    if min(shape.key_heads, shape.value_heads, shape.key_head_dim, shape.value_head_dim) < 1:
        raise UnsupportedConfig(f"linear attention sizes must be 1 or more; got {shape}")
    if shape.conv_kernel < 2:  # the state keeps the last conv_kernel - 1 inputs
        raise UnsupportedConfig(f"linear_conv_kernel_dim must be 2 or more; got {shape.conv_kernel}")
    if shape.value_heads % shape.key_heads:
        raise UnsupportedConfig("linear_num_value_heads must be a multiple of linear_num_key_heads")
    return shape


def _query_scale(rope_params: dict[str, dict[str, Any]]) -> QueryScale | None:
    with_beta = [r for r in rope_params.values() if r.get("llama_4_scaling_beta")]
    if not with_beta:
        return None
    scales = {(r["llama_4_scaling_beta"], r.get("original_max_position_embeddings")) for r in with_beta}
    if len(scales) != 1 or len(with_beta) != len(rope_params):  # one scale for every layer, or not served
        raise UnsupportedConfig("llama_4_scaling_beta differs between rope settings")
    ((beta, positions),) = scales
    if not isinstance(positions, int) or positions < 1:
        raise UnsupportedConfig("llama_4_scaling_beta needs original_max_position_embeddings, 1 or more")
    return QueryScale(float(beta), positions)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _embedding_multiplier(config: Any, family: Family) -> float:
    if family.scale_embeddings:
        return float(config.hidden_size) ** 0.5
    return float(getattr(config, "embedding_multiplier", 1.0) or 1.0)


def _rope_parameters(config: Any) -> dict[str, dict[str, Any]]:
    """Rope settings keyed by layer type ("" when one set serves every layer)."""
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    nested = all(isinstance(v, dict) for v in params.values()) and params
    table = dict(params) if nested else {"": dict(params)}
    partial = getattr(config, "partial_rotary_factor", None)
    for key, rope in table.items():
        rope.setdefault("rope_type", rope.get("type", "default"))
        if rope["rope_type"] == "dynamic" and rope.get("alpha"):  # Hunyuan's NTK alpha: a fixed, larger base
            rope["rope_type"] = "default"
            dim = int(_head_dim(config) * float(rope.get("partial_rotary_factor", partial or 1.0)))
            rope["rope_theta"] = float(rope["rope_theta"]) * float(rope.pop("alpha")) ** (dim / (dim - 2))
        if rope["rope_type"] not in ROPE_TYPES:
            raise UnsupportedConfig(f"rope type {rope['rope_type']!r} is not supported ({', '.join(ROPE_TYPES)})")
        if partial is not None:
            rope.setdefault("partial_rotary_factor", float(partial))
        table[key] = {k: v for k, v in rope.items() if k != "type"}
    return table


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _layer_specs(config: Any, rope_params: dict[str, dict[str, Any]], family: Family) -> tuple[LayerSpec, ...]:
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or (
        ["sliding_attention" if window else "full_attention"] * num_layers
    )
    uses_rope = getattr(config, "no_rope_layers", None) or [1] * num_layers  # SmolLM3: 0 means no rope
    if family.global_layers_without_rope and window:  # EXAONE 4 rotates only its sliding layers' q and k
        uses_rope = [int(kind == "sliding_attention") for kind in layer_types]
    specs = []
    for i in range(num_layers):
        kind = layer_types[i]
        if kind == "linear_attention" and family.linear_attention:
            specs.append(LayerSpec(sliding_window=None, rope=None, linear=True))
            continue
        if kind not in ("full_attention", "sliding_attention"):
            raise UnsupportedConfig(f"layer type {kind!r} is not supported (full_attention, sliding_attention)")
        rope_key = kind if kind in rope_params else ""
        specs.append(
            LayerSpec(
                sliding_window=int(window) if kind == "sliding_attention" and window else None,
                rope=rope_key if uses_rope[i] else None,
            )
        )
    if specs and all(spec.linear for spec in specs):  # the KV cache, and so the engine's memory plan, needs one
        raise UnsupportedConfig("every layer is linear_attention: at least one full_attention layer is needed")
    return tuple(specs)
