"""A checkpoint folder (Hugging Face Llama or Qwen2 layout, safetensors) written as GGUF the way
llama.cpp's convert_hf_to_gguf.py writes it: llama.cpp's tensor names, q and k rows of the
"llama" architecture permuted for its interleaved rope ("qwen2" rotates halves, as stored), and,
for the tests of engine/gguf_import.py, the tokenizer as GGUF metadata (a byte-level BPE: the
"gpt2" tokenizer model with its merges, special tokens typed as control, the chat template).
Matrices as F32, or as Q8_0 quantized by the `gguf` package's own quantizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

LAYER_NAMES = {  # transformers name (after model.layers.N.) -> GGUF name (after blk.N.)
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3's per-head norms
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3's fused projections
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_CONTROL, _NORMAL = 3, 1  # llama.cpp's token types


def permute_for_interleaved_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model_dir: Path, cfg: dict, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under llama.cpp's names, q/k permuted for the "llama" architecture."""
    state = load_file(str(model_dir / "model.safetensors"))
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    if "lm_head.weight" in state and not cfg.get("tie_word_embeddings", False):
        yield "output.weight", state["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in LAYER_NAMES.items():
            tensor = state.get(f"model.layers.{i}.{hf_name}")
            if tensor is None:
                continue
            if arch == "llama" and hf_name.startswith("self_attn.q_proj"):
                tensor = permute_for_interleaved_rope(tensor, cfg["num_attention_heads"])
            elif arch == "llama" and hf_name.startswith("self_attn.k_proj"):
                tensor = permute_for_interleaved_rope(tensor, cfg["num_key_value_heads"])
            yield f"blk.{i}.{gguf_name}", tensor


def write_gguf(
    model_dir: Path,
    out: Path,
    *,
    quant: str = "F32",
    tokenizer: bool = True,
    arch: str | None = None,
    tokenizer_pre: str = "qwen2",
) -> Path:
    """`model_dir` as a GGUF file at `out`; quant "F32" or "Q8_0" (matrices; norms stay F32).
    Without `tokenizer` the file says tokenizer model "none" (llama.cpp's bench files)."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    archs = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "qwen3_5_text": "qwen35"}
    arch = arch or archs[cfg["model_type"]]
    rope = {"rope_type": "default", **(cfg.get("rope_parameters") or {})}
    rope_theta = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    partial = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(head_dim * partial))  # Phi-4-mini's partial rope: fewer
    writer.add_rope_freq_base(float(rope_theta))
    if "head_dim" in cfg:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope["rope_type"] in ("linear", "yarn"):  # as llama.cpp's converter writes a scaled rope
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(float(rope["factor"]))
        if rope["rope_type"] == "yarn":
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if quant == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_vocab_size(cfg["vocab_size"])
    if tokenizer:
        _add_tokenizer(writer, model_dir, cfg, tokenizer_pre)
    else:
        writer.add_tokenizer_model("none")
    if cfg.get("sliding_window"):
        writer.add_sliding_window(int(cfg["sliding_window"]))
    if arch == "qwen35":
        _add_qwen35_metadata(writer, cfg)
    if rope["rope_type"] == "longrope":  # Phi-3's: both factor lists as tensors, as llama.cpp writes them
        writer.add_rope_scaling_orig_ctx_len(int(cfg["original_max_position_embeddings"]))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if rope["rope_type"] == "llama3":  # llama.cpp keeps Llama 3's scaling as per-frequency divisors
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, float(rope_theta), head_dim))
    for name, tensor in (qwen35_tensors if arch == "qwen35" else gguf_tensors)(model_dir, cfg, arch):
        data = tensor.to(torch.float32).contiguous().numpy().astype(np.float32, copy=False)
        if quant == "Q8_0" and data.ndim == 2 and data.shape[1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)  # shape from its bytes
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_qwen35_metadata(writer, cfg: dict) -> None:
    """Qwen3.5's Gated DeltaNet sizes and layer kinds, under the keys llama.cpp's converter writes."""
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    writer.add_array("qwen35.attention.recurrent_layers", [kind == "linear_attention" for kind in cfg["layer_types"]])
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_sections([11, 11, 10, 0])


QWEN35_NAMES = {  # Qwen3_5ForCausalLM name (after model.layers.N.) -> GGUF name (after blk.N.)
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
}


def qwen35_tensors(model_dir: Path, cfg: dict, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A Qwen3_5ForCausalLM checkpoint's tensors as llama.cpp's converter writes them (its
    conversion/qwen.py): RMSNorm weights as 1 + w (not the Gated DeltaNet's own norm), A_log as
    -exp(A_log), the convolution without its middle axis, and with more value heads than key heads
    every value-head axis reordered from grouped by key head to tiled. Checked on 2026-11-27 against
    the converter of llama.cpp as vendored in llama-cpp-python 0.3.36: every tensor equal."""
    state = load_file(str(model_dir / "model.safetensors"))
    one_plus = ("layernorm.weight", "q_norm.weight", "k_norm.weight")
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"] + 1
    if "lm_head.weight" in state and not cfg.get("tie_word_embeddings", False):
        yield "output.weight", state["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in QWEN35_NAMES.items():
            tensor = state.get(f"model.layers.{i}.{hf_name}")
            if tensor is None:
                continue
            if hf_name.endswith(one_plus):
                tensor = tensor + 1
            elif hf_name.endswith("A_log"):
                tensor = -torch.exp(tensor)
            elif hf_name.endswith("conv1d.weight"):
                tensor = tensor[:, 0]
            if hf_name.startswith("linear_attn."):
                tensor = _tiled_value_heads(hf_name, tensor, cfg)
            yield f"blk.{i}.{gguf_name}", tensor


def _tiled_value_heads(name: str, tensor: torch.Tensor, cfg: dict) -> torch.Tensor:
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if k_heads == v_heads:
        return tensor
    per_k, v_dim, qk = v_heads // k_heads, cfg["linear_value_head_dim"], 2 * k_heads * cfg["linear_key_head_dim"]

    def tiled(x: torch.Tensor, dim: int, head: int) -> torch.Tensor:
        shape = x.shape
        grouped = x.reshape(*shape[:dim], k_heads, per_k, head, *shape[dim + 1 :])
        return grouped.transpose(dim, dim + 1).reshape(shape)

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.cat([tensor[:qk], tiled(tensor[qk:], 0, v_dim)])
    if name.endswith("in_proj_z.weight"):
        return tiled(tensor, 0, v_dim)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return tiled(tensor, 0, 1)
    if name.endswith("out_proj.weight"):
        return tiled(tensor, 1, v_dim)
    return tensor


def llama3_rope_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """Llama 3's rope scaling as the divisor of each frequency, as llama.cpp's converter computes it."""
    import math

    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    original = rope.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_tokenizer(writer, model_dir: Path, cfg: dict, pre: str) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer model."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{added["content"]: added["id"] for added in tok["added_tokens"]}}
    tokens = [""] * len(vocab)
    for text, token_id in vocab.items():
        tokens[token_id] = text
    special = {added["id"] for added in tok["added_tokens"] if added["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)  # llama.cpp's pre-tokenizer name
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL if i in special else _NORMAL for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_chat_template(tok_cfg["chat_template"])
