"""A GGUF file (llama.cpp's and Ollama's format) turned into a model folder this server serves.

`server.py import-gguf FILE --out DIR` writes DIR in Hugging Face layout: config.json and the
tokenizer (tokenizer.json, tokenizer_config.json, the chat template) as transformers reads them
from the file's metadata, generation_config.json with its EOS ids, and model.safetensors with every
tensor dequantized (Q4_K, Q8_0, ...: transformers' reader over the `gguf` package's dequantizers)
and renamed to the family's names, llama.cpp's q/k row order for interleaved rope undone. The
native engine then serves DIR like any release (engine.quantization = "int8" or "int4" quantizes
it again at load). Only families the native engine serves are imported (engine/native/families.py);
anything else is refused before the tensors are read, naming the architecture.

A quantized file's rounding stays in the weights: the folder holds what the GGUF held, not the
original release. The import holds the whole model in memory once, at the dtype written.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

GGUF_MAGIC = b"GGUF"
DTYPES = ("auto", "float32", "float16", "bfloat16")
# GGUF tensor types kept as they are by dtype "auto"; a file holding any other (a quantized one)
# is written in bfloat16, which keeps every value a 4- to 8-bit block format can hold closely.
_PLAIN_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


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
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.native.families import FAMILIES

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers: "GGUF model with architecture X is not supported yet."
        raise GGUFImportError(f"{gguf_path}: cannot read its model config: {_first_line(exc)}") from None
    if config.model_type not in FAMILIES:
        raise GGUFImportError(
            f"{gguf_path}: its model ({config.model_type}) is not a family the native engine serves "
            f"({', '.join(FAMILIES)})"
        )
    chosen = _dtype_for(gguf_path) if dtype == "auto" else dtype
    torch_dtype = getattr(torch, chosen)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # a file without tokenizer metadata (tokenizer.ggml.model "none")
        raise GGUFImportError(f"{gguf_path}: cannot read its tokenizer: {_first_line(exc)}") from None
    with torch.device("meta"):  # the names the tensors map to, without allocating the model
        skeleton = AutoModelForCausalLM.from_config(config)
    try:
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    except Exception as exc:  # a tensor type the gguf package cannot dequantize, a truncated file
        raise GGUFImportError(f"{gguf_path}: cannot read its tensors: {_first_line(exc)}") from None
    expected = set(skeleton.state_dict())
    weights = {key: _as_tensor(value, torch_dtype) for key, value in tensors.items() if key in expected}
    missing = sorted(expected - set(weights) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        more = " ..." if len(missing) > 3 else ""
        raise GGUFImportError(f"{gguf_path}: tensors missing for {', '.join(missing[:3])}{more}")
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the embedding serves as the output matrix
    config.dtype = torch_dtype
    scratch = out_dir.with_name(out_dir.name + ".importing")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        if _tokenizer_pre(gguf_path) in _IGNORE_MERGES_PRE:
            _set_ignore_merges(scratch / "tokenizer.json")
        eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
        GenerationConfig(eos_token_id=eos, bos_token_id=config.bos_token_id).save_pretrained(scratch)
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


def _dtype_for(gguf_path: Path) -> str:
    """dtype "auto": the file's own float type when every tensor is one (F32, F16 or BF16), else bfloat16."""
    from gguf import GGUFReader

    kinds = {tensor.tensor_type.name for tensor in GGUFReader(str(gguf_path)).tensors}
    matrices = {kind for kind in kinds if kind != "F32"} or {"F32"}  # norms are F32 in every file
    if len(matrices) == 1:
        (kind,) = matrices
        return _PLAIN_TYPES.get(kind, "bfloat16")
    return "bfloat16"


def _tokenizer_pre(gguf_path: Path) -> str | None:
    """The file's tokenizer.ggml.pre (llama.cpp's name for its pre-tokenizer), if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.pre")
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def _set_ignore_merges(tokenizer_file: Path) -> None:
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    if data.get("model", {}).get("type") == "BPE":
        data["model"]["ignore_merges"] = True
        tokenizer_file.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def _as_tensor(value, dtype):
    import torch

    tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
    return tensor.to(dtype).contiguous()


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
