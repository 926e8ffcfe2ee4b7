"""A checkpoint's image preprocessing (CLIP-style, as in preprocessor_config.json) with Pillow + NumPy.

Matches `transformers`' CLIPImageProcessor (PIL backend) number for number: resize the short
edge with PIL's filter, center-crop (zero-padded when smaller), scale by 1/255, normalize
by mean and std, channels first. torchvision is not needed (nor installable beside our torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from engine.native.loader import ModelLoadError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class ClipImageProcessor:
    shortest_edge: int
    crop_height: int
    crop_width: int
    resample: int  # PIL filter id (3: bicubic)
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_dir(cls, model_dir: Path) -> ClipImageProcessor:
        where = Path(model_dir) / "preprocessor_config.json"
        try:
            cfg = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{where}: cannot read the image preprocessing config: {exc}") from None
        size, crop = cfg.get("size", {"shortest_edge": 224}), cfg.get("crop_size", {"height": 224, "width": 224})
        if not isinstance(size, dict) or "shortest_edge" not in size or not cfg.get("do_center_crop", True):
            raise ModelLoadError(f"{where}: only CLIP-style preprocessing (shortest_edge resize + center crop)")
        return cls(
            shortest_edge=int(size["shortest_edge"]),
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            resample=int(cfg.get("resample", 3)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            mean=tuple(cfg.get("image_mean", CLIP_MEAN)),
            std=tuple(cfg.get("image_std", CLIP_STD)),
        )

    def resize_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the short edge is resized, as transformers rounds it."""
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)

    def __call__(self, image: Image.Image) -> np.ndarray:
        """An RGB image -> float32 [3, crop_height, crop_width]."""
        resized = image.convert("RGB").resize(self.resize_size(*image.size), resample=self.resample)
        pixels = np.asarray(resized).transpose(2, 0, 1)  # [3, H, W] uint8
        pixels = self._center_crop(pixels)
        scaled = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None, None]
        return ((scaled - mean) / std).astype(np.float32)

    def _center_crop(self, pixels: np.ndarray) -> np.ndarray:
        _, h, w = pixels.shape
        ch, cw = self.crop_height, self.crop_width
        if h < ch or w < cw:  # pad with zeros to at least the crop size, centered
            padded = np.zeros((pixels.shape[0], max(h, ch), max(w, cw)), dtype=pixels.dtype)
            top, left = (padded.shape[1] - h + 1) // 2, (padded.shape[2] - w + 1) // 2
            padded[:, top : top + h, left : left + w] = pixels
            pixels, h, w = padded, padded.shape[1], padded.shape[2]
        top, left = (h - ch) // 2, (w - cw) // 2
        return pixels[:, top : top + ch, left : left + cw]
