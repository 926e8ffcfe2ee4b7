"""The LLaVA vision side: a CLIP vision tower and the multimodal projector, run during prefill.

Loads `vision_tower.*` and `multi_modal_projector.*` from a Hugging Face LLaVA checkpoint
(config.json `model_type: llava`) and turns a batch of preprocessed images into rows of the
language model's input embeddings. Numerics follow `transformers`' CLIPVisionTransformer
(pre-LayerNorm, quick-GELU MLP, the hidden state of `vision_feature_layer`) and LlavaMultiModalProjector.
`step_embeddings` places those rows where a step's scheduled image tokens sit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine.native.loader import ModelLoadError, _TensorReader, _weight_files

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def is_llava(model_dir: Path) -> bool:
    cfg_file = Path(model_dir) / "config.json"
    try:
        return json.loads(cfg_file.read_text(encoding="utf-8")).get("model_type") == "llava"
    except (OSError, ValueError):
        return False


@dataclass(frozen=True, slots=True)
class VisionArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int  # layers run: up to and including vision_feature_layer
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    projector_act: str
    keep_cls: bool  # vision_feature_select_strategy 'full' keeps the CLS row; 'default' drops it
    image_token_id: int
    text_hidden_size: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        return self.num_patches + (1 if self.keep_cls else 0)


def load_vision_args(model_dir: Path) -> VisionArgs:
    where = Path(model_dir) / "config.json"
    cfg = json.loads(where.read_text(encoding="utf-8"))
    vc, tc = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
    if vc.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ModelLoadError(f"{where}: vision tower {vc.get('model_type')!r} is not supported (CLIP only)")
    total_layers = int(vc.get("num_hidden_layers", 24))
    feature_layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(feature_layer, int):
        raise ModelLoadError(f"{where}: vision_feature_layer must be one integer, got {feature_layer!r}")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    act, projector_act = vc.get("hidden_act", "quick_gelu"), cfg.get("projector_hidden_act", "gelu")
    for name in (act, projector_act):
        if name not in _ACTIVATIONS:
            raise ModelLoadError(f"{where}: activation {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return VisionArgs(
        hidden_size=int(vc["hidden_size"]),
        intermediate_size=int(vc["intermediate_size"]),
        # hidden_states[0] is the embedding output, so layer k of the list is after k layers.
        num_layers=feature_layer % (total_layers + 1),
        num_heads=int(vc["num_attention_heads"]),
        image_size=int(vc["image_size"]),
        patch_size=int(vc["patch_size"]),
        num_channels=int(vc.get("num_channels", 3)),
        layer_norm_eps=float(vc.get("layer_norm_eps", 1e-5)),
        hidden_act=act,
        projector_act=projector_act,
        keep_cls=strategy == "full",
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 32000))),
        text_hidden_size=int(tc["hidden_size"]),
    )


class VisionTower:
    """CLIP vision encoder + LLaVA projector over plain tensors (weights loaded once)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.args = a = load_vision_args(model_dir)
        files = _weight_files(Path(model_dir))
        prefix = (
            "vision_tower.vision_model."
            if any(n.startswith("vision_tower.vision_model.") for n in files)
            else "vision_tower."
        )
        r = _TensorReader(files, dtype, device)
        h, i, c, p = a.hidden_size, a.intermediate_size, a.num_channels, a.patch_size
        self.patch = r.get(f"{prefix}embeddings.patch_embedding.weight", (h, c, p, p))
        self.cls = r.get(f"{prefix}embeddings.class_embedding", (h,))
        self.pos = r.get(f"{prefix}embeddings.position_embedding.weight", (a.num_patches + 1, h))
        self.pre_norm = (r.get(f"{prefix}pre_layrnorm.weight", (h,)), r.get(f"{prefix}pre_layrnorm.bias", (h,)))
        self.layers = [self._layer(r, f"{prefix}encoder.layers.{n}.", h, i) for n in range(a.num_layers)]
        m = "multi_modal_projector."
        t = a.text_hidden_size
        self.proj1 = (r.get(f"{m}linear_1.weight", (t, h)), r.get(f"{m}linear_1.bias", (t,)))
        self.proj2 = (r.get(f"{m}linear_2.weight", (t, t)), r.get(f"{m}linear_2.bias", (t,)))
        self.dtype, self.device = dtype, device

    @staticmethod
    def _layer(r: _TensorReader, p: str, h: int, i: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        def wb(name: str, out: int, inp: int | None) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (out,) if inp is None else (out, inp)
            return r.get(f"{p}{name}.weight", shape), r.get(f"{p}{name}.bias", (out,))

        qkv = [wb(f"self_attn.{n}_proj", h, h) for n in "qkv"]
        return {
            "norm1": wb("layer_norm1", h, None),
            "qkv": (torch.cat([w for w, _ in qkv]), torch.cat([b for _, b in qkv])),
            "out": wb("self_attn.out_proj", h, h),
            "norm2": wb("layer_norm2", h, None),
            "fc1": wb("mlp.fc1", i, h),
            "fc2": wb("mlp.fc2", h, i),
        }

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_images, channels, H, W] -> [num_images, num_image_tokens, text_hidden]."""
        a = self.args
        x = F.conv2d(pixel_values.to(self.device, self.dtype), self.patch, stride=a.patch_size)  # [n, h, gh, gw]
        x = x.flatten(2).transpose(1, 2)  # [n, patches, h]
        cls = self.cls.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos
        x = F.layer_norm(x, (a.hidden_size,), *self.pre_norm, a.layer_norm_eps)
        for layer in self.layers:
            x = self._block(layer, x)
        if not a.keep_cls:
            x = x[:, 1:]
        x = F.linear(x, *self.proj1)
        return F.linear(_ACTIVATIONS[a.projector_act](x), *self.proj2)

    def _block(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        n, t, h = x.shape
        hd = h // a.num_heads
        y = F.layer_norm(x, (h,), layer["norm1"][0], layer["norm1"][1], a.layer_norm_eps)
        q, k, v = F.linear(y, *layer["qkv"]).view(n, t, 3, a.num_heads, hd).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)  # full attention over patches: [n, heads, t, hd]
        x = x + F.linear(o.transpose(1, 2).reshape(n, t, h), *layer["out"])
        y = F.layer_norm(x, (h,), layer["norm2"][0], layer["norm2"][1], a.layer_norm_eps)
        return x + F.linear(_ACTIVATIONS[a.hidden_act](F.linear(y, *layer["fc1"])), *layer["fc2"])

    def step_embeddings(
        self, seqs: Sequence[Any], num_scheduled: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, embeddings) of this step's image tokens, or None when it has none.

        Rows follow the runner's flat layout: one-token rows (decodes) first, then the prefill
        chunks in batch order. Images needed this step are encoded together, once each.
        """
        spans = _scheduled_image_spans(seqs, num_scheduled)
        if not spans:
            return None
        unique = {img.content_hash: img for _, img, _, _ in spans}
        pixels = torch.from_numpy(np.stack([img.pixel_values for img in unique.values()]))
        encoded = dict(zip(unique, self.encode(pixels), strict=True))  # hash -> [tokens, text_hidden]
        rows, values = [], []
        for row_start, img, first, last in spans:
            rows.append(torch.arange(row_start, row_start + last - first))
            values.append(encoded[img.content_hash][first:last])
        return torch.cat(rows).to(self.device), torch.cat(values)


def _scheduled_image_spans(seqs: Sequence[Any], num_scheduled: Sequence[int]) -> list[tuple[Any, ...]]:
    """(first row, image, first image token, end image token) for each image overlap this step."""
    order = [i for i, n in enumerate(num_scheduled) if n == 1] + [i for i, n in enumerate(num_scheduled) if n > 1]
    spans, row = [], 0
    for i in order:
        seq, n = seqs[i], num_scheduled[i]
        start = seq.num_computed_tokens
        for img in seq.images:
            lo, hi = max(start, img.offset), min(start + n, img.offset + img.length)
            if lo < hi:
                spans.append((row + lo - start, img, lo - img.offset, hi - img.offset))
        row += n
    return spans
