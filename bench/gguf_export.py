"""Write a bench checkpoint (Hugging Face Llama or Qwen2 layout, fp32 safetensors) as GGUF, so
llama.cpp runs the very same weights: f32 written with the `gguf` package, Q8_0 made from it by
llama.cpp's own quantizer (llama_model_quantize). No tokenizer goes in (tokenizer model "none"):
the bench feeds token ids.

llama.cpp's "llama" architecture applies RoPE to interleaved pairs, transformers to the two
halves of each head, so q and k rows are permuted as llama.cpp's convert_hf_to_gguf.py does;
"qwen2" uses the halves (NEOX) as stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

_LAYER_NAMES = {  # transformers name (after model.layers.N.) -> GGUF name (after blk.N.)
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute_for_interleaved_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(model_dir: Path, cfg: dict, arch: str):
    state = load_file(str(model_dir / "model.safetensors"))
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    if "lm_head.weight" in state and not cfg.get("tie_word_embeddings", False):
        yield "output.weight", state["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in _LAYER_NAMES.items():
            tensor = state.get(f"model.layers.{i}.{hf_name}")
            if tensor is None:
                continue
            if arch == "llama" and hf_name.startswith("self_attn.q_proj"):
                tensor = _permute_for_interleaved_rope(tensor, cfg["num_attention_heads"])
            elif arch == "llama" and hf_name.startswith("self_attn.k_proj"):
                tensor = _permute_for_interleaved_rope(tensor, cfg["num_key_value_heads"])
            yield f"blk.{i}.{gguf_name}", tensor


def write_f32_gguf(model_dir: Path, out: Path) -> Path:
    """The checkpoint as an f32 GGUF (written once; an existing file is kept)."""
    import gguf

    if out.exists():
        return out
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = {"llama": "llama", "qwen2": "qwen2"}[cfg["model_type"]]
    rope_theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    scratch = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(scratch), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("none")
    writer.add_vocab_size(cfg["vocab_size"])
    for name, tensor in _gguf_tensors(model_dir, cfg, arch):
        writer.add_tensor(name, tensor.to(torch.float32).contiguous().numpy().astype(np.float32, copy=False))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    scratch.rename(out)
    return out


def quantize_q8_0(f32_gguf: Path, out: Path) -> Path:
    """llama.cpp's quantizer: every matrix (the embedding included) to Q8_0, as `llama-quantize ... Q8_0` does."""
    return _quantize(f32_gguf, out, "LLAMA_FTYPE_MOSTLY_Q8_0")


def quantize_q4_0(f32_gguf: Path, out: Path) -> Path:
    """llama.cpp's quantizer to Q4_0, as `llama-quantize ... Q4_0` does (its output matrix stays wider)."""
    return _quantize(f32_gguf, out, "LLAMA_FTYPE_MOSTLY_Q4_0")


def _quantize(f32_gguf: Path, out: Path, ftype: str) -> Path:
    import ctypes

    import llama_cpp

    if out.exists():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = 2
    scratch = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(f32_gguf).encode(), str(scratch).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {f32_gguf}")
    scratch.rename(out)
    return out
