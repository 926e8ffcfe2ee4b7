"""Reads a Hugging Face checkpoint folder of a served family (families.py) into engine-ready weights.

Owns every checkpoint quirk in one place: config.json read through transformers' config class
(so every layout it ever wrote resolves the same way), single or sharded safetensors, tied or
untied embeddings, 16-bit weights converted to the engine dtype, each family's tensor names.
It fuses q/k/v and gate/up projections for fewer matmuls, and reorders the q/k rows of an
interleaved-rope family for the engine's rotate-half rope. Every failure names the file at fault.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from engine.native.families import FAMILIES, ModelArgs, Norms, QKNorm, UnsupportedConfig, model_args_from_config
from engine.native.linear_attention import LinearAttentionWeights
from engine.types import EngineError

log = structlog.get_logger(__name__)


class ModelLoadError(EngineError):
    """A missing or malformed checkpoint file; the message names it."""


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer. The four matmul weights are plain tensors as loaded; on CPUs with the
    compiled kernels the runner swaps them for cpu_ops.PackedLinear (model.LinearPreparer, as each layer is read).
    A norm the family does not have is None; Gemma's (1 + weight) is stored as that sum."""

    input_norm: torch.Tensor | None  # [hidden] before attention (None: OLMo 2)
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # Qwen2-style attention bias
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor | None  # [hidden] before the MLP (None: OLMo 2)
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim] (per head) or [num_heads * head_dim] (whole)
    k_norm: torch.Tensor | None = None  # [head_dim] or [num_kv_heads * head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden] on attention's output (Gemma, OLMo 2)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] on the MLP's output (Gemma, OLMo 2)
    # A Gated DeltaNet layer (Qwen3.5): qkv is its fused input projection [in_proj_rows, hidden],
    # o_proj its output projection [hidden, value_dim], the rest here. Its attention layers' qkv
    # ends with the output gate's rows: [q | k | v | gate].
    linear: LinearAttentionWeights | None = None


@dataclass(frozen=True, slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot parse JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


# Where a checkpoint's tensors sit: (prefix of the names the engine reads, the checkpoint's prefix
# for them), first match wins; () for a plain causal LM.
Renames = tuple[tuple[str, str], ...]

# Multimodal checkpoints whose language model the engine serves (config.json's model_type; its
# `text_config` describes that model). LLaVA's vision tower is served too (engine/native/vision.py);
# Gemma 3's (4B and up: SigLIP), Qwen3.5's and Mistral 3's (Ministral 3, Mistral Small 3.1: Pixtral)
# are not, so those models are text only.
WRAPPED_LANGUAGE_MODELS = frozenset({"llava", "gemma3", "qwen3_5", "mistral3"})
# Where a wrapper's language model sits: under `language_model.`, its lm_head too (as transformers 4
# saved them), or under `model.language_model.` beside a top-level lm_head (as transformers 5 saves
# them); language_model_names finds which from the weight files.
WRAPPED_LAYOUTS: tuple[Renames, ...] = (
    (("", "language_model."),),
    (("model.", "model.language_model."), ("lm_head.", "lm_head.")),
)


def language_model_names(model_dir: Path) -> Renames:
    """Where the language model's weights sit in the checkpoint: () for a plain causal LM."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    if not isinstance(cfg, dict) or cfg.get("model_type") not in WRAPPED_LANGUAGE_MODELS:
        return ()
    try:
        names = _weight_files(Path(model_dir))
    except ModelLoadError:  # reading the weights names it
        return WRAPPED_LAYOUTS[0]
    for layout in WRAPPED_LAYOUTS:
        if _renamed("model.embed_tokens.weight", layout, to_checkpoint=True) in names:
            return layout
    return WRAPPED_LAYOUTS[0]


def _renamed(name: str, renames: Renames, *, to_checkpoint: bool) -> str | None:
    for engine_prefix, checkpoint_prefix in renames:
        old, new = (engine_prefix, checkpoint_prefix) if to_checkpoint else (checkpoint_prefix, engine_prefix)
        if name.startswith(old):
            return new + name.removeprefix(old)
    return None


def _text_config(cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    """A wrapper's language model config. Gemma 3's releases spell out only what differs from
    Gemma3TextConfig's defaults (no vocab_size or head counts), so it is read through the wrapper's
    own config class, defaults filled in, as transformers reads it."""
    if cfg.get("model_type") == "qwen3_5":  # the releases tie (or not) at the top level, which transformers reads
        text = cfg["text_config"]
        return {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
    if cfg.get("model_type") != "gemma3":
        return cfg["text_config"]
    from transformers import CONFIG_MAPPING

    try:
        text = CONFIG_MAPPING["gemma3"].from_dict(_without_auto_dtype(cfg, where)).text_config.to_dict()
    except Exception as exc:  # transformers 5's strict dataclasses raise their own error types
        raise ModelLoadError(f"{where}: malformed value: {_last_line(exc)}") from None
    for key in ("dtype", "torch_dtype"):  # the checkpoint's dtype is read from its weights
        text.pop(key, None)
    return text


def load_model_args(model_dir: Path) -> ModelArgs:
    """Parse and check config.json, through transformers' config class for its family.

    A multimodal checkpoint (WRAPPED_LANGUAGE_MODELS): its language model's part."""
    where = Path(model_dir) / "config.json"
    cfg = _read_json(where)
    if cfg.get("model_type") in WRAPPED_LANGUAGE_MODELS and isinstance(cfg.get("text_config"), dict):
        cfg = _text_config(cfg, where)
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        hint = " (a multimodal checkpoint: its text model is not served on its own yet)" if "text_config" in cfg else ""
        raise ModelLoadError(f"{where}: model_type {model_type!r} is not one of {', '.join(FAMILIES)}{hint}")
    for key in _REQUIRED_KEYS:
        if key not in cfg:
            raise ModelLoadError(f"{where}: missing key {key!r}")
    quantized = cfg.get("quantization_config")
    if quantized:  # FP8, GPTQ, AWQ, bitsandbytes...: its weights need its own scales, which the engine does not read
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ModelLoadError(
            f"{where}: a pre-quantized checkpoint (quantization_config, quant_method {method!r}) is not supported: "
            'serve the unquantized (bfloat16 or float16) release; engine.quantization = "int8" or "int4" '
            "quantizes it at load"
        )
    from transformers import CONFIG_MAPPING

    cfg = _without_auto_dtype(cfg, where)
    try:
        args = model_args_from_config(CONFIG_MAPPING[model_type].from_dict(cfg))
    except UnsupportedConfig as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    except Exception as exc:  # transformers 5 checks types with huggingface_hub's strict dataclasses, own error types
        raise ModelLoadError(f"{where}: malformed value: {_last_line(exc)}") from None
    _check_model_args(args, where)
    return args


def _without_auto_dtype(cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    """cfg without a dtype of "auto" (unset: transformers looked it up as torch.auto); a ModelLoadError
    for a dtype that names no torch dtype ("fp16", 123)."""
    cfg = dict(cfg)
    for key in ("dtype", "torch_dtype"):
        value = cfg.get(key)
        if value is None or value == "auto":
            cfg.pop(key, None)
        elif not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype):
            raise ModelLoadError(f"{where}: {key} must name a dtype (bfloat16, float16, float32); got {value!r}")
    return cfg


def _last_line(exc: Exception) -> str:
    """The line of a multi-line validation error that says what is wrong, without its type name:
    "Field 'rms_norm_eps' expected float, got int (value: 0)"."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return re.sub(r"^\w+(Error|Exception): ", "", lines[-1])


# What the engine sizes tensors and loops by: (ModelArgs attribute, config.json key), each at least 1.
_POSITIVE_COUNTS = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("intermediate_size", "intermediate_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"),
    ("num_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("max_position_embeddings", "max_position_embeddings"),
)


def _check_model_args(args: ModelArgs, where: Path) -> None:
    """Values transformers accepts but the engine cannot run: a zero or negative size (0 layers
    divided by zero, a negative context failed in torch, a zero one refused every request), a
    norm epsilon outside (0, 1), a rope base that is not a positive number."""
    for attr, key in _POSITIVE_COUNTS:
        if (value := getattr(args, attr)) < 1:
            raise ModelLoadError(f"{where}: {key} must be 1 or more; got {value}")
    if not 0 < args.rms_norm_eps < 1:
        raise ModelLoadError(f"{where}: rms_norm_eps must be more than 0 and less than 1; got {args.rms_norm_eps}")
    if args.num_heads % args.num_kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
    for layer in args.layers:
        if layer.sliding_window is not None and layer.sliding_window < 1:
            raise ModelLoadError(f"{where}: sliding_window must be 1 or more; got {layer.sliding_window}")
    for _, params in args.rope_parameters:
        for name, value in params:
            if name in ("rope_theta", "factor") and not _is_positive_number(value):
                raise ModelLoadError(f"{where}: {name} must be a number more than 0; got {value!r}")


def _is_positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def checkpoint_dtype(model_dir: Path) -> torch.dtype | None:
    """The dtype config.json says the weights were saved in (None if it does not say)."""
    cfg = _read_json(Path(model_dir) / "config.json")
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if not isinstance(name, str):
        return None
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file: the single file when there is one (a stale shard index
    beside it is not read, as in transformers), else the shard index's."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return dict.fromkeys(_tensor_names(single), single)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelLoadError(f"{shard}: missing (listed in {index.name})")
        return files
    pickled = any(model_dir.glob("pytorch_model*.bin"))
    hint = (
        " (pytorch_model.bin weights are not read: they are pickles, which can run code; convert them "
        "with transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir))"
        if pickled
        else ""
    )
    raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json{hint}")


# The most positions served from config.json's max_position_embeddings alone: the engine builds its
# rope tables (and sizes its block tables) for the whole context up front, so a config saying 1e9
# asked for tens of GB before the first request. Qwen2.5-1M's 1,010,000 is under it.
MAX_POSITIONS_WITHOUT_MAX_MODEL_LEN = 1 << 20


def preflight(model_dir: Path, *, max_model_len: int = 0) -> None:
    """What can be checked of a checkpoint without loading it, in well under a second: config.json
    (a supported family with sane values, a context the engine can size when `max_model_len`, the
    configured one, is 0) and the weight files (present, headers readable, where the shard index
    says). Raises ModelLoadError naming the problem; the server checks every model this way at
    start, before loading any, so a broken folder stops it with one line instead of a traceback."""
    args = load_model_args(model_dir)
    if not max_model_len and args.max_position_embeddings > MAX_POSITIONS_WITHOUT_MAX_MODEL_LEN:
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: max_position_embeddings {args.max_position_embeddings} is more than "
            f"{MAX_POSITIONS_WITHOUT_MAX_MODEL_LEN} positions, which the engine would size its tables for up front: "
            "set the model's max_model_len (models.<name>.max_model_len) to the context to serve"
        )
    files = _weight_files(model_dir)
    names = {path: set(_tensor_names(path)) for path in sorted(set(files.values()))}
    for name, path in files.items():
        if name not in names[path]:  # a shard index that does not match its shards
            actual = [other.name for other in sorted(model_dir.glob("*.safetensors")) if name in _names_or_empty(other)]
            where = f"; it is in {actual[0]}" if actual else ""
            raise ModelLoadError(
                f"{model_dir / 'model.safetensors.index.json'}: lists {name} in {path.name}, which lacks it{where}"
            )


def _names_or_empty(path: Path) -> list[str]:
    try:
        return _tensor_names(path)
    except ModelLoadError:
        return []


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from None


class _TensorReader:
    """Reads named tensors across shards, keeping each shard open once."""

    def __init__(self, files: dict[str, Path], dtype: torch.dtype, device: torch.device, renames: Renames = ()):
        self._files = files  # by the engine's names
        self._renames = renames  # names are looked up as the engine's and read as the checkpoint's
        self._open: dict[Path, Any] = {}
        self.dtype, self._device = dtype, device

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        from safetensors import safe_open

        path = self._files.get(name)
        if path is None:
            raise ModelLoadError(f"{name}: missing from the checkpoint's safetensors files")
        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:
                raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from None
        try:
            tensor = self._open[path].get_tensor(_renamed(name, self._renames, to_checkpoint=True) or name)
        except Exception as exc:  # safetensors' own error: the shard index placed the tensor in the wrong file
            raise ModelLoadError(f"{path}: cannot read {name}: {exc}") from None
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{path}: {name} has shape {tuple(tensor.shape)}, config.json implies {shape}")
        if tensor.dtype not in _WEIGHT_DTYPES:  # cast as it is, an int8 or fp8 weight answered nothing
            raise ModelLoadError(
                f"{path}: {name} is stored as {str(tensor.dtype).removeprefix('torch.')}, a quantized weight with "
                "no quantization_config in config.json to read it by: serve the checkpoint's bfloat16/float16 "
                'release (engine.quantization = "int8" quantizes it at load)'
            )
        return tensor.to(device=self._device, dtype=dtype or self.dtype)


_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _rope_pairs_as_halves(rows: torch.Tensor, args: ModelArgs, rotary_dim: int) -> torch.Tensor:
    """qkv's rows ([(heads + 2 * kv_heads) * head_dim, hidden], or its bias), each q and k head's
    first rotary_dim reordered from interleaved rope's pairs (2i, 2i + 1) to rotate-half's
    (i, i + rotary_dim / 2). Rotate-half rope of the reordered q is the interleaved rope of the
    original, reordered: with k reordered alike every q.k, and so attention's output, is the same."""
    pairs = torch.arange(rotary_dim).view(-1, 2)  # [rotary_dim / 2, 2]: row i is the pair (2i, 2i + 1)
    order = torch.cat([pairs[:, 0], pairs[:, 1], torch.arange(rotary_dim, args.head_dim)])
    heads = rows.unflatten(0, (-1, args.head_dim))  # [heads + 2 * kv_heads, head_dim, ...]
    num_qk = args.num_heads + args.num_kv_heads  # v's heads stay as they are
    return torch.cat([heads[:num_qk, order], heads[num_qk:]]).flatten(0, 1)


# Each arrangement's RMSNorms as the checkpoint names them: (before attention, on attention's
# output, before the MLP, on the MLP's output); None where it has none.
NORM_NAMES: dict[Norms, tuple[str | None, str | None, str | None, str | None]] = {
    Norms.PRE: ("input_layernorm", None, "post_attention_layernorm", None),
    Norms.SANDWICH: (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    Norms.SANDWICH_GLM4: (
        "input_layernorm",
        "post_self_attn_layernorm",
        "post_attention_layernorm",
        "post_mlp_layernorm",
    ),
    Norms.POST: (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}


def _as_read(layer: LayerWeights) -> LayerWeights:
    return layer


class _LayerReader:
    """Reads one layer's tensors under the family's names and shapes."""

    def __init__(self, reader: _TensorReader, args: ModelArgs, index: int):
        self.r, self.a, self.p = reader, args, f"model.layers.{index}."
        self.rope = args.layers[index].rope

    def norm(self, name: str, size: int) -> torch.Tensor:
        weight = self.r.get(f"{self.p}{name}.weight", (size,), torch.float32)
        return (weight + self.a.family.norm_offset).to(self.r.dtype)

    def attention(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        qkv, bias = self.attention_as_stored()
        if not self.a.family.interleaved_rope or self.rope is None:
            return qkv, bias
        rotary_dim = self.a.rotary_dim(self.rope)
        qkv = _rope_pairs_as_halves(qkv, self.a, rotary_dim)
        return qkv, None if bias is None else _rope_pairs_as_halves(bias, self.a, rotary_dim)

    def attention_as_stored(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        a, p = self.a, f"{self.p}self_attn."
        h, sizes = a.hidden_size, (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim)
        if a.family.fused_qkv:
            return self.r.get(f"{p}qkv_proj.weight", (sum(sizes), h)), None
        if a.family.linear_attention:  # Qwen3.5: q_proj holds each head's query, then its output gate
            q_gate = self.r.get(f"{p}q_proj.weight", (2 * sizes[0], h)).view(a.num_heads, 2, a.head_dim, h)
            k, v = (self.r.get(f"{p}{n}_proj.weight", (o, h)) for n, o in zip("kv", sizes[1:], strict=True))
            return torch.cat([q_gate[:, 0].reshape(-1, h), k, v, q_gate[:, 1].reshape(-1, h)]).contiguous(), None
        qkv = torch.cat(
            [self.r.get(f"{p}{n}_proj.weight", (o, h)) for n, o in zip("qkv", sizes, strict=True)]
        ).contiguous()
        if not self.r.has(f"{p}q_proj.bias"):
            return qkv, None
        return qkv, torch.cat([self.r.get(f"{p}{n}_proj.bias", (o,)) for n, o in zip("qkv", sizes, strict=True)])

    def mlp(self) -> torch.Tensor:
        a, p = self.a, f"{self.p}mlp."
        if a.family.fused_gate_up:
            return self.r.get(f"{p}gate_up_proj.weight", (2 * a.intermediate_size, a.hidden_size))
        pair = [self.r.get(f"{p}{n}_proj.weight", (a.intermediate_size, a.hidden_size)) for n in ("gate", "up")]
        return torch.cat(pair).contiguous()

    def qk_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a = self.a
        if a.family.qk_norm is QKNorm.NONE:
            return None, None
        whole = a.family.qk_norm is QKNorm.WHOLE
        q_size, k_size = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim) if whole else (a.head_dim, a.head_dim)
        if a.family.qk_norm is QKNorm.PER_HEAD_AFTER_ROPE:  # Hunyuan's names
            return self.norm("self_attn.query_layernorm", q_size), self.norm("self_attn.key_layernorm", k_size)
        return self.norm("self_attn.q_norm", q_size), self.norm("self_attn.k_norm", k_size)

    def linear_attention(self) -> LayerWeights:
        """A Gated DeltaNet layer (Qwen3.5): in_proj_qkv, _z, _b and _a fused into one matmul."""
        a, h, p = self.a, self.a.hidden_size, f"{self.p}linear_attn."
        s = a.linear_attention
        assert s is not None  # a linear layer's family has the shape
        rows = {"qkv": s.conv_dim, "z": s.value_dim, "b": s.value_heads, "a": s.value_heads}
        in_proj = torch.cat([self.r.get(f"{p}in_proj_{n}.weight", (o, h)) for n, o in rows.items()]).contiguous()
        heads = (s.value_heads,)
        conv = self.r.get(f"{p}conv1d.weight", (s.conv_dim, 1, s.conv_kernel), torch.float32)[:, 0]
        extra = LinearAttentionWeights(
            conv_taps=conv.t().contiguous(),
            dt_bias=self.r.get(f"{p}dt_bias", heads, torch.float32),
            neg_a=-self.r.get(f"{p}A_log", heads, torch.float32).exp(),
            norm=self.r.get(f"{p}norm.weight", (s.value_head_dim,), torch.float32),  # plain weight, no 1 + w
        )
        return LayerWeights(
            input_norm=self.norm("input_layernorm", h),
            qkv=in_proj,
            qkv_bias=None,
            o_proj=self.r.get(f"{p}out_proj.weight", (h, s.value_dim)),
            post_norm=self.norm("post_attention_layernorm", h),
            gate_up=self.mlp(),
            down=self.r.get(f"{self.p}mlp.down_proj.weight", (h, a.intermediate_size)),
            linear=extra,
        )

    def layer(self) -> LayerWeights:
        a, h = self.a, self.a.hidden_size
        for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.qkv_proj"):
            if self.r.has(f"{self.p}{name}.bias"):  # e.g. Llama with attention_bias or mlp_bias
                raise ModelLoadError(f"{self.p}{name}.bias is not supported (biases only on q, k and v, as in Qwen2)")
        qkv, bias = self.attention()
        q_norm, k_norm = self.qk_norms()
        attn_in, attn_out, mlp_in, mlp_out = (
            None if name is None else self.norm(name, h) for name in NORM_NAMES[a.family.norms]
        )
        return LayerWeights(
            input_norm=attn_in,
            qkv=qkv,
            qkv_bias=bias,
            o_proj=self.r.get(f"{self.p}self_attn.o_proj.weight", (h, a.num_heads * a.head_dim)),
            post_norm=mlp_in,
            gate_up=self.mlp(),
            down=self.r.get(f"{self.p}mlp.down_proj.weight", (h, a.intermediate_size)),
            q_norm=q_norm,
            k_norm=k_norm,
            attn_out_norm=attn_out,
            mlp_out_norm=mlp_out,
        )


def load_model_weights(
    model_dir: Path,
    args: ModelArgs,
    dtype: torch.dtype,
    device: torch.device,
    *,
    renames: Renames = (),
    prepare: Callable[[LayerWeights], LayerWeights] | None = None,
) -> ModelWeights:
    """`renames`: where the language model sits in a larger checkpoint (language_model_names).
    `prepare` turns each decoder layer into what the model runs on (packed, quantized) as soon as it
    is read, so that only one layer is held as read at a time (model.LinearPreparer.layer)."""
    model_dir = Path(model_dir)
    files = _weight_files(model_dir)
    if renames:
        renamed = ((_renamed(name, renames, to_checkpoint=False), path) for name, path in files.items())
        files = {name: path for name, path in renamed if name is not None}
    reader = _TensorReader(files, dtype, device, renames)
    layers = [
        (prepare or _as_read)(
            _LayerReader(reader, args, i).linear_attention() if spec.linear else _LayerReader(reader, args, i).layer()
        )
        for i, spec in enumerate(args.layers)
    ]
    h = args.hidden_size
    embed = reader.get("model.embed_tokens.weight", (args.vocab_size, h))
    tied = args.tie_word_embeddings or not reader.has("lm_head.weight")
    if tied and not args.tie_word_embeddings:
        log.warning("lm_head_missing_using_tied_embeddings", model_dir=str(model_dir))
    lm_head = embed if tied else reader.get("lm_head.weight", (args.vocab_size, h))
    norm = (reader.get("model.norm.weight", (h,), torch.float32) + args.family.norm_offset).to(dtype)
    return ModelWeights(embed=embed, layers=tuple(layers), norm=norm, lm_head=lm_head)
