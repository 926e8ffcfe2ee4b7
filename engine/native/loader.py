"""Reads a Hugging Face Llama-family checkpoint folder into engine-ready weights.

Owns every checkpoint quirk in one place: config.json layouts of old and new `transformers`
(`rope_theta` vs `rope_parameters`/`rope_scaling`), single or sharded safetensors, tied or
untied embeddings, 16-bit weights upcast to the engine dtype. It fuses q/k/v and gate/up
projections for fewer matmuls. Every failure names the file at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from engine.types import EngineError

log = structlog.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class ModelLoadError(EngineError):
    """A missing or malformed checkpoint file; the message names it."""


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_scaling: tuple[tuple[str, float], ...]  # llama3/linear settings, sorted (key, value)
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def num_parameters(self) -> int:
        """Parameters of the matmuls a token passes through (embedding lookup excluded)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer. The four matmul weights are plain tensors as loaded; on CPUs with the
    compiled kernels the runner swaps them for kernels.PackedLinear (model.pack_linear_layers)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # Qwen2-style attention bias
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass(frozen=True, slots=True)
class LlamaWeights:
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


def _rope_settings(cfg: dict[str, Any], where: Path) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    """(theta, rope type, scaling settings) from any of the layouts transformers has written."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{where}: rope_parameters/rope_scaling must be an object")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scaling = tuple(sorted((k, float(params[k])) for k in keys if k in params))
    return float(theta), rope_type, scaling


def load_llama_args(model_dir: Path) -> LlamaArgs:
    """Parse and check config.json."""
    where = Path(model_dir) / "config.json"
    cfg = _read_json(where)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{where}: model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    try:
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, rope_type, scaling = _rope_settings(cfg, where)
        args = LlamaArgs(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_type=rope_type,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{where}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: malformed value: {exc}") from None
    if args.num_heads % args.num_kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
        raise ModelLoadError(f"{where}: sliding-window attention is not supported")
    return args


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or the single file."""
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
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    return {name: single for name in _tensor_names(single)}


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from None


class _TensorReader:
    """Reads named tensors across shards, keeping each shard open once."""

    def __init__(self, files: dict[str, Path], dtype: torch.dtype, device: torch.device):
        self._files = files
        self._open: dict[Path, Any] = {}
        self._dtype, self._device = dtype, device

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        from safetensors import safe_open

        path = self._files.get(name)
        if path is None:
            raise ModelLoadError(f"{name}: missing from the checkpoint's safetensors files")
        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:
                raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from None
        tensor = self._open[path].get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{path}: {name} has shape {tuple(tensor.shape)}, config.json implies {shape}")
        return tensor.to(device=self._device, dtype=self._dtype)


def load_llama_weights(model_dir: Path, args: LlamaArgs, dtype: torch.dtype, device: torch.device) -> LlamaWeights:
    model_dir = Path(model_dir)
    reader = _TensorReader(_weight_files(model_dir), dtype, device)
    h, d = args.hidden_size, args.head_dim
    q_out, kv_out = args.num_heads * d, args.num_kv_heads * d
    layers = []
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        attn = [reader.get(f"{p}self_attn.{n}_proj.weight", (o, h)) for n, o in (("q", q_out), ("k", kv_out), ("v", kv_out))]
        bias = None
        if reader.has(f"{p}self_attn.q_proj.bias"):
            sizes = (("q", q_out), ("k", kv_out), ("v", kv_out))
            bias = torch.cat([reader.get(f"{p}self_attn.{n}_proj.bias", (o,)) for n, o in sizes])
        for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            if reader.has(f"{p}{name}.bias"):  # e.g. Llama with attention_bias or mlp_bias
                raise ModelLoadError(
                    f"{model_dir}: {p}{name}.bias is not supported (biases only on q, k and v, as in Qwen2)"
                )
        mlp = [reader.get(f"{p}mlp.{n}_proj.weight", (args.intermediate_size, h)) for n in ("gate", "up")]
        layers.append(
            LayerWeights(
                input_norm=reader.get(f"{p}input_layernorm.weight", (h,)),
                qkv=torch.cat(attn).contiguous(),
                qkv_bias=bias,
                o_proj=reader.get(f"{p}self_attn.o_proj.weight", (h, q_out)),
                post_norm=reader.get(f"{p}post_attention_layernorm.weight", (h,)),
                gate_up=torch.cat(mlp).contiguous(),
                down=reader.get(f"{p}mlp.down_proj.weight", (h, args.intermediate_size)),
            )
        )
    embed = reader.get("model.embed_tokens.weight", (args.vocab_size, h))
    tied = args.tie_word_embeddings or not reader.has("lm_head.weight")
    if tied and not args.tie_word_embeddings:
        log.warning("lm_head_missing_using_tied_embeddings", model_dir=str(model_dir))
    lm_head = embed if tied else reader.get("lm_head.weight", (args.vocab_size, h))
    norm = reader.get("model.norm.weight", (h,))
    return LlamaWeights(embed=embed, layers=tuple(layers), norm=norm, lm_head=lm_head)
