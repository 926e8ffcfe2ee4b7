"""Write a bench checkpoint (Hugging Face Llama or Qwen2 layout, fp32 safetensors) as GGUF, so
llama.cpp runs the very same weights: f32 written with the `gguf` package, Q8_0 made from it by
llama.cpp's own quantizer (llama_model_quantize). No tokenizer goes in (tokenizer model "none"):
the bench feeds token ids.

llama.cpp's "llama" architecture applies RoPE to interleaved pairs, transformers to the two
halves of each head, so q and k rows are permuted as llama.cpp's convert_hf_to_gguf.py does;
"qwen2" uses the halves (NEOX) as stored.
"""

from __future__ import annotations

from pathlib import Path

from testing.tiny_gguf import write_gguf


def write_f32_gguf(model_dir: Path, out: Path) -> Path:
    """The checkpoint as an f32 GGUF (written once; an existing file is kept)."""
    if out.exists():
        return out
    scratch = out.with_suffix(".partial")
    write_gguf(model_dir, scratch, quant="F32", tokenizer=False)
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
