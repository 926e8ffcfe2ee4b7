"""Qwen3.5 GGUF files (general.architecture "qwen35": llama.cpp's and Ollama's) read back into a
Qwen3_5ForCausalLM config and weights (engine/gguf_import.py writes the folder).

transformers' GGUF reader does not know this architecture, so the config comes from the file's
`qwen35.*` metadata and each tensor is dequantized by the `gguf` package and renamed here. What
llama.cpp's converter changed is undone: its RMSNorm weights hold 1 + w (Qwen3.5's are
zero-centred; the Gated DeltaNet's own norm is not), A_log is stored as -exp(A_log), dt_bias
under another name, the convolution without its middle axis, and, where there are more value
heads than key heads, every value-head axis reordered from grouped by key head to tiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

ARCH = "qwen35"
# GGUF tensor name (after "blk.N.") -> Qwen3_5ForCausalLM's (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_ONE_PLUS = ("_norm.weight", "norm.weight")  # stored as 1 + w, but ssm_norm (checked first)


class Qwen35Error(ValueError):
    """The file's Qwen3.5 metadata or tensors do not fit together; the message says which."""


def config_dict(field: Callable[[str], Any], num_tokens: int, has_output: bool) -> dict[str, Any]:
    """The Qwen3_5TextConfig arguments the file's metadata gives (`field(key)`: its value or None)."""

    def need(key: str) -> Any:
        value = field(f"{ARCH}.{key}")
        if value is None:
            raise Qwen35Error(f"its metadata lacks {ARCH}.{key}")
        return value

    num_layers, head_dim = int(need("block_count")), int(need("attention.key_length"))
    value_heads = int(need("ssm.time_step_rank"))
    recurrent = field(f"{ARCH}.attention.recurrent_layers")
    if isinstance(recurrent, list) and len(recurrent) >= num_layers:
        linear = [bool(x) for x in recurrent[:num_layers]]
    else:  # an older file: every full_attention_interval-th layer attends
        interval = int(field(f"{ARCH}.full_attention_interval") or 4)
        linear = [(i + 1) % interval != 0 for i in range(num_layers)]
    rotated = int(field(f"{ARCH}.rope.dimension_count") or head_dim)
    return {
        "vocab_size": num_tokens,
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": int(need("attention.head_count")),
        "num_key_value_heads": int(need("attention.head_count_kv")),
        "head_dim": head_dim,
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(need("rope.freq_base")),
            "partial_rotary_factor": rotated / head_dim,
        },
        "linear_conv_kernel_dim": int(need("ssm.conv_kernel")),
        "linear_key_head_dim": int(need("ssm.state_size")),
        "linear_num_key_heads": int(need("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(need("ssm.inner_size")) // value_heads,
        "layer_types": ["linear_attention" if x else "full_attention" for x in linear],
        "tie_word_embeddings": not has_output,
    }


def hf_name(gguf_name: str) -> str | None:
    """The checkpoint name of a GGUF tensor; None for one the text model does not read (MTP layers past
    the last, vision)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdecimal() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def undo_conversion(name: str, array: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """A tensor (float32, checkpoint name `name`) back as the release holds it."""
    if name.endswith("linear_attn.A_log"):
        array = np.log(-array)
    elif name.endswith(_ONE_PLUS) and not name.endswith("linear_attn.norm.weight"):
        array = array - 1.0
    elif name.endswith("conv1d.weight"):
        array = array[:, None, :]
    if ".linear_attn." in name:
        array = _grouped(name, array, config)
    return array


def _grouped(name: str, array: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Undo the converter's value-head reordering (grouped by key head -> tiled) where there are more
    value heads than key heads: the same axes it reordered, back."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if k_heads == v_heads:
        return array
    per_k, v_dim, k_dim = v_heads // k_heads, config["linear_value_head_dim"], config["linear_key_head_dim"]
    qk = 2 * k_heads * k_dim

    def back(x: np.ndarray, axis: int, head: int) -> np.ndarray:
        shape = x.shape
        tiled = x.reshape(*shape[:axis], per_k, k_heads, head, *shape[axis + 1 :])
        return np.swapaxes(tiled, axis, axis + 1).reshape(shape)

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([array[:qk], back(array[qk:], 0, v_dim)])
    if name.endswith("in_proj_z.weight"):
        return back(array, 0, v_dim)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return back(array, 0, 1)
    if name.endswith("out_proj.weight"):
        return back(array, 1, v_dim)
    return array
