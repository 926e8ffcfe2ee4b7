"""A GGUF file (llama.cpp's and Ollama's format) turned into a model folder this server serves.

`server.py import-gguf FILE --out DIR` writes DIR in Hugging Face layout: config.json and the
tokenizer (tokenizer.json, tokenizer_config.json, the chat template) as transformers reads them
from the file's metadata, generation_config.json with its EOS ids, and model.safetensors with every
tensor dequantized (Q4_K, Q8_0, ...: transformers' reader over the `gguf` package's dequantizers)
and renamed to the family's names, llama.cpp's q/k row order for interleaved rope undone. The
native engine then serves DIR like any release (engine.quantization = "int8" or "int4" quantizes
it again at load). What transformers' reader leaves out is carried here from the file: the head
size, the rope scaling (linear and YaRN metadata, Llama 3's divisors tensor) and the whole-word
lookup of Llama 3 style vocabularies. Only the GGUF architectures in ARCHITECTURES are imported;
anything else is refused before the tensors are read, naming the architecture.

A quantized file's rounding stays in the weights: the folder holds what the GGUF held, not the
original release. The import holds the whole model in memory once, at the dtype written.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from engine import gguf_qwen35

log = structlog.get_logger(__name__)

GGUF_MAGIC = b"GGUF"
DTYPES = ("auto", "float32", "float16", "bfloat16")
# GGUF tensor types kept as they are by dtype "auto"; a file holding any other (a quantized one)
# is written in bfloat16, which keeps every value a 4- to 8-bit block format can hold closely.
_PLAIN_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Tokens that end an answer wherever the vocabulary has them, besides the file's EOS/EOT/EOM ids:
# the texts llama.cpp's llama-vocab.cpp treats so (its "end of generation" set), of the families
# imported. A file often names one id (Phi-3's <|endoftext|>) while the chat ends turns with
# another (<|end|>): without these the answer would run on to max_tokens.
_END_OF_GENERATION_TEXTS = frozenset(
    {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>", "<EOT>"}
)
# GGUF architectures (general.architecture) imported: those whose settings this import carries in
# full and has checked against the original checkpoint (tests/engine/test_gguf_import.py); qwen35
# (Qwen3.5), which transformers' reader does not know, through gguf_qwen35.py.
# transformers reads more (Gemma), but drops settings of theirs, such as Gemma 3's scaled rope
# on its global layers, that would serve a model subtly wrong.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "qwen35")


# tokenizer.ggml.pre values whose tokenizers look a whole pre-token up in the vocabulary before
# merging (tokenizers' BPE `ignore_merges`: Llama 3's, Mistral's tekken), as llama.cpp's
# llama-vocab.cpp sets them; transformers' GGUF reader leaves it off, which split some words
# ("Việt") into other ids than the original's (bench/gguf_tokenizers.py).
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken"})


class GGUFImportError(Exception):
    """The file cannot be imported; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Imported:
    out_dir: Path
    model_type: str
    dtype: str
    num_tensors: int
    seconds: float


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts as GGUF does (Ollama's blobs have no .gguf suffix)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def import_gguf(gguf_path: Path, out_dir: Path, dtype: str = "auto") -> Imported:
    """Write `out_dir` (which must not exist, or be empty) from `gguf_path`; GGUFImportError says
    what is wrong. Written into a sibling folder first and renamed, so `out_dir` is whole or absent."""
    started = time.monotonic()
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir).resolve()
    if not gguf_path.is_file():
        raise GGUFImportError(f"{gguf_path}: no such file")
    if not is_gguf(gguf_path):
        raise GGUFImportError(f"{gguf_path}: not a GGUF file (it does not start with 'GGUF')")
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise GGUFImportError(f"{out_dir}: already exists and is not an empty folder; give a new folder")
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # a truncated or damaged file
        raise GGUFImportError(f"{gguf_path}: cannot read it as GGUF: {_first_line(exc)}") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"{gguf_path}: importing its architecture ({arch}) is not supported; these are: "
            f"{', '.join(ARCHITECTURES)} (Llama, Mistral and SmolLM files are 'llama'). Serve it with llama.cpp's "
            'llama-server and relay to it (backend = "openai", docs/scale-out.md)'
        )
    chosen = _dtype_for(reader) if dtype == "auto" else dtype
    torch_dtype = getattr(torch, chosen)
    if arch == gguf_qwen35.ARCH:  # transformers' GGUF reader does not know it
        config, weights = _read_qwen35(reader, gguf_path, torch_dtype)
    else:
        config, weights = _read_with_transformers(reader, arch, gguf_path, torch_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # a file without tokenizer metadata (tokenizer.ggml.model "none")
        raise GGUFImportError(f"{gguf_path}: cannot read its tokenizer: {_first_line(exc)}") from None
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the embedding serves as the output matrix
    config.dtype = torch_dtype
    scratch = out_dir.with_name(out_dir.name + ".importing")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        _as_llama_cpp_tokenizes(reader, scratch / "tokenizer.json")
        eos = _end_of_generation_ids(reader, tokenizer.get_vocab())
        GenerationConfig(eos_token_id=eos or None, bos_token_id=config.bos_token_id).save_pretrained(scratch)
        save_file(weights, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        (scratch / "gguf_import.json").write_text(
            json.dumps({"source": str(gguf_path), "dtype": chosen}, indent=2) + "\n", encoding="utf-8"
        )
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        scratch.rename(out_dir)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    seconds = time.monotonic() - started
    log.info("gguf_imported", source=str(gguf_path), out=str(out_dir), model_type=config.model_type, dtype=chosen)
    return Imported(out_dir, config.model_type, chosen, len(weights), seconds)


def _read_with_transformers(reader, arch: str, gguf_path: Path, torch_dtype) -> tuple[Any, dict]:
    """config and weights through transformers' GGUF reader, with what it leaves out carried over."""
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.native.families import FAMILIES

    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # a file that lacks a setting transformers needs
        raise GGUFImportError(f"{gguf_path}: cannot read its model config: {_first_line(exc)}") from None
    if config.model_type == "mistral":  # a 'llama' file named "mistral": gguf-py maps no tensor names for
        # that type, and llama.cpp runs such a file as Llama, over the whole context (no window)
        config = CONFIG_MAPPING["llama"].from_dict({**config.to_dict(), "model_type": "llama"})
    if config.model_type not in FAMILIES:
        raise GGUFImportError(
            f"{gguf_path}: its model ({config.model_type}) is not a family the native engine serves "
            f"({', '.join(FAMILIES)})"
        )
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None:  # a head size of its own (Qwen3's 128), which transformers' reader leaves to defaults
        config.head_dim = int(key_length)
    config.rope_parameters = _rope(reader, arch, config, gguf_path)
    if hasattr(config, "sliding_window"):  # only what the file names (Mistral's 4096 default is not used)
        window = _field(reader, f"{arch}.attention.sliding_window")
        config.sliding_window = int(window) if window else None
    with torch.device("meta"):  # the names the tensors map to, without allocating the model
        skeleton = AutoModelForCausalLM.from_config(config)
    try:
        # each tensor cast to the dtype written as soon as it is dequantized: float32 copies of a
        # whole model (12 GB at 3B parameters) are never held at once
        loaded = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch_dtype
        )
        tensors = loaded["tensors"]
    except Exception as exc:  # a tensor type the gguf package cannot dequantize, a truncated file
        raise GGUFImportError(f"{gguf_path}: cannot read its tensors: {_first_line(exc)}") from None
    weights = {key: _as_tensor(value, torch_dtype) for key, value in tensors.items()}
    return config, _checked(weights, skeleton, config, gguf_path)


def _read_qwen35(reader, gguf_path: Path, torch_dtype) -> tuple[Any, dict]:
    """config and weights of a Qwen3.5 file (gguf_qwen35.py), each tensor dequantized and cast as it is read."""
    import torch
    from gguf.quants import dequantize
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFImportError(f"{gguf_path}: it holds no token_embd.weight")
    try:
        args = gguf_qwen35.config_dict(lambda key: _field(reader, key), int(embed.shape[-1]), "output.weight" in names)
        config = CONFIG_MAPPING["qwen3_5_text"](**args)
    except Exception as exc:  # Qwen35Error, or values transformers' config class refuses
        raise GGUFImportError(f"{gguf_path}: cannot read its model config: {_first_line(exc)}") from None
    for kind in ("bos", "eos", "padding"):
        token_id = _field(reader, f"tokenizer.ggml.{kind}_token_id")
        setattr(config, "pad_token_id" if kind == "padding" else f"{kind}_token_id", token_id)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    weights = {}
    try:
        for tensor in reader.tensors:
            name = gguf_qwen35.hf_name(tensor.name)
            if name is None or name.startswith(f"model.layers.{config.num_hidden_layers}."):  # MTP layers past the last
                continue
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            if not array.flags.writeable:  # an F32 tensor is a view of the mapped file
                array = array.copy()
            weights[name] = torch.from_numpy(gguf_qwen35.undo_conversion(name, array, args)).to(torch_dtype)
    except Exception as exc:  # a tensor type the gguf package cannot dequantize, a truncated file
        raise GGUFImportError(f"{gguf_path}: cannot read its tensors: {_first_line(exc)}") from None
    return config, _checked(weights, skeleton, config, gguf_path)


def _checked(weights: dict, skeleton, config, gguf_path: Path) -> dict:
    """The tensors the model has, each of its shape; a GGUFImportError naming what is missing or off."""
    expected = skeleton.state_dict()
    weights = {key: value.contiguous() for key, value in weights.items() if key in expected}
    missing = sorted(set(expected) - set(weights) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        more = " ..." if len(missing) > 3 else ""
        raise GGUFImportError(f"{gguf_path}: tensors missing for {', '.join(missing[:3])}{more}")
    for key, value in weights.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise GGUFImportError(
                f"{gguf_path}: {key} has shape {tuple(value.shape)}, its metadata implies {tuple(expected[key].shape)}"
            )
    return weights


def _dtype_for(reader) -> str:
    """dtype "auto": the file's own float type when every tensor is one (F32, F16 or BF16), else bfloat16."""
    kinds = {tensor.tensor_type.name for tensor in reader.tensors}
    matrices = {kind for kind in kinds if kind != "F32"} or {"F32"}  # norms are F32 in every file
    if len(matrices) == 1:
        (kind,) = matrices
        return _PLAIN_TYPES.get(kind, "bfloat16")
    return "bfloat16"


def _field(reader, key: str):
    """A metadata value of the file (a string or a number), or None when it has none."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8", "replace")
    return value.tolist()[0] if len(value) == 1 else value.tolist()


def _rope(reader, arch: str, config, gguf_path: Path) -> dict:
    """The rope settings the file holds, which transformers' GGUF reader leaves out (it keeps only
    the base): Phi-3's partial rope and longrope factors (tensors), a linear or YaRN scaling from
    the metadata, and Llama 3's scaling, which llama.cpp keeps as a tensor of per-frequency divisors
    (rope_freqs) whose parameters are found again here by trying the ones its releases use; anything
    else is refused rather than served wrong."""
    theta = float(config.rope_parameters["rope_theta"])
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rope: dict = {**config.rope_parameters, "rope_type": "default", "rope_theta": theta}  # Phi-3's partial factor kept
    rotated = _field(reader, f"{arch}.rope.dimension_count")
    if rotated is not None and rotated != head_dim:
        if arch != "phi3":
            raise GGUFImportError(f"{gguf_path}: rope over {rotated} of {head_dim} dimensions is not imported")
        rope["partial_rotary_factor"] = rotated / head_dim  # Phi-4-mini's: the first dimensions, as halves
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        factor = _field(reader, f"{arch}.rope.scaling.factor")
        if kind not in ("linear", "yarn") or factor is None:
            raise GGUFImportError(f"{gguf_path}: rope scaling {kind!r} is not imported (linear and yarn are)")
        rope = {**rope, "rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            original = _field(reader, f"{arch}.rope.scaling.original_context_length")
            rope["original_max_position_embeddings"] = int(original or config.max_position_embeddings)
    tensors = {t.name: t for t in reader.tensors if t.name.startswith("rope_")}
    if "rope_factors_long.weight" in tensors:  # Phi-3's longrope: both factor lists, as tensors
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original is None or "rope_factors_short.weight" not in tensors:
            raise GGUFImportError(f"{gguf_path}: its longrope factors come without their original context")
        rope = {
            **rope,
            "rope_type": "longrope",
            "long_factor": _factors(tensors["rope_factors_long.weight"]),
            "short_factor": _factors(tensors["rope_factors_short.weight"]),
            "original_max_position_embeddings": int(original),
        }
        config.original_max_position_embeddings = int(original)
    divisors = tensors.get("rope_freqs.weight")
    if divisors is not None:
        found = _llama3_rope(np.asarray(divisors.data, dtype=np.float64).reshape(-1), theta, head_dim)
        if found is None:
            raise GGUFImportError(f"{gguf_path}: its rope_freqs match no Llama 3 rope scaling; it is not imported")
        rope = {**rope, **found}
    return rope


def _end_of_generation_ids(reader, vocab: dict[str, int]) -> list[int]:
    """Every id that ends an answer, as llama.cpp reads the file: its EOS, EOT and EOM ids, and the
    vocabulary's tokens of _END_OF_GENERATION_TEXTS."""
    ids = {_field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")} - {None}
    ids |= {token_id for text, token_id in vocab.items() if text in _END_OF_GENERATION_TEXTS}
    return sorted(int(i) for i in ids)


def _factors(tensor) -> list[float]:
    """A factor list the file holds as float32, back as the decimals its config.json gave (7
    significant digits are float32's own, so nothing else changes)."""
    return [float(f"{x:.7g}") for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


def _llama3_rope(divisors, theta: float, head_dim: int) -> dict | None:
    """Llama 3's rope scaling that gives these per-frequency divisors: the factor is the largest,
    the frequency bands are the releases' (1 and 4) over a power-of-two original context."""
    factor = float(divisors.max())
    wavelens = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    for log2 in range(6, 21):
        original, low, high = 2**log2, 1.0, 4.0
        smooth = (original / wavelens - low) / (high - low)
        expected = np.where(
            wavelens < original / high,
            1.0,
            np.where(wavelens > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if expected.shape == divisors.shape and np.allclose(expected, divisors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    return None


def _as_llama_cpp_tokenizes(reader, tokenizer_file: Path) -> None:
    """Where transformers' rebuilt tokenizer.json splits text otherwise than llama.cpp (and so
    than the original, on llama.cpp's test sets: bench/gguf_tokenizers.py), make it split as
    llama.cpp does: a Llama 3 style BPE looks whole pre-tokens up before merging (ignore_merges);
    a SentencePiece vocabulary with add_space_prefix (Llama 2's, Mistral's) puts "▁" before every
    text, also one that starts with a space, which transformers' Metaspace "first" leaves out."""
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    changed = False
    if model.get("type") == "BPE" and _field(reader, "tokenizer.ggml.pre") in _IGNORE_MERGES_PRE:
        model["ignore_merges"] = changed = True
    spm = _field(reader, "tokenizer.ggml.model") == "llama" and _field(reader, "tokenizer.ggml.add_space_prefix") != 0
    if spm and (data.get("pre_tokenizer") or {}).get("type") == "Metaspace":
        data["normalizer"] = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            ],
        }
        data["pre_tokenizer"] = None
        changed = True
    if changed:
        tokenizer_file.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def _as_tensor(value, dtype):
    import torch

    tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
    return tensor.to(dtype).contiguous()


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
