"""Images in a vision model's prompt: where each image's tokens go and what the engine gets.

`ImageTokenizer` is the model's tokenizer with one addition: a message whose text holds
IMAGE_SENTINEL gets, at that place, the model's image token repeated once per embedding row
(so context checks and billing count image tokens). User text is still tokenized literally,
so typing "<image>" never makes an image slot. `ImagePrompter` preprocesses images and finds
their token runs in the final prompt, giving the engine its `ImageInput`s.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from engine.native.image_processor import ClipImageProcessor
from engine.native.vision import load_vision_args
from engine.tokenizer import Tokenizer
from engine.types import IMAGE_PLACEHOLDER as IMAGE_SENTINEL
from engine.types import ImageInput


class ImageCountMismatch(ValueError):
    """The prompt's image slots and the images sent differ in number."""


class PreparedImages:
    """A vision model's images already decoded and preprocessed, by the sha256 of their encoded
    bytes: (content hash, pixels). An image in a conversation's history comes back every turn;
    decoding a phone photo again took ~190 ms (12 MP JPEG, Pillow, 2-core Intel Xeon VM with
    AVX-512). The least recently used go past the byte cap each `put` is given
    (images.prepared_cache_mb). Event loop only."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[str, np.ndarray]] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def get(self, digest: str) -> tuple[str, np.ndarray] | None:
        found = self._entries.get(digest)
        if found is not None:
            self._entries.move_to_end(digest)
            self.num_hits += 1
        return found

    def put(self, digest: str, prepared: tuple[str, np.ndarray], max_bytes: int) -> None:
        if digest in self._entries or prepared[1].nbytes > max_bytes:
            return
        self._entries[digest] = prepared
        self.num_bytes += prepared[1].nbytes
        while self.num_bytes > max_bytes:
            _digest, (_hash, pixels) = self._entries.popitem(last=False)
            self.num_bytes -= pixels.nbytes


@dataclass(frozen=True, slots=True)
class ImagePrompter:
    image_token_id: int
    num_image_tokens: int
    processor: ClipImageProcessor
    prepared: PreparedImages = field(default_factory=PreparedImages, compare=False, repr=False)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ImagePrompter:
        args = load_vision_args(model_dir)
        return cls(args.image_token_id, args.num_image_tokens, ClipImageProcessor.from_dir(model_dir))

    def preprocess(self, image: Image.Image) -> np.ndarray:
        return self.processor(image)

    def num_slots(self, prompt_token_ids: list[int] | tuple[int, ...]) -> int:
        return sum(1 for t in prompt_token_ids if t == self.image_token_id) // self.num_image_tokens

    def image_inputs(
        self, prompt_token_ids: list[int] | tuple[int, ...], images: list[tuple[str, np.ndarray]]
    ) -> tuple:
        """One ImageInput per run of image tokens, matched in order with (content hash, pixels)."""
        n = self.num_image_tokens
        offsets = [i for i, t in enumerate(prompt_token_ids) if t == self.image_token_id]
        starts = offsets[::n]
        if len(offsets) != n * len(images) or any(offsets[k * n + n - 1] - s != n - 1 for k, s in enumerate(starts)):
            raise ImageCountMismatch(f"the prompt has {len(offsets) // max(n, 1)} image slots for {len(images)} images")
        return tuple(ImageInput(s, n, h, pixels) for s, (h, pixels) in zip(starts, images, strict=True))


class ImageTokenizer(Tokenizer):
    """A vision model's tokenizer: IMAGE_SENTINEL in message text becomes the image's tokens."""

    image_prompter: ImagePrompter

    @classmethod
    def for_model(cls, model_dir: Path, *, chat_template_name: str = "") -> ImageTokenizer:
        tokenizer = cls.from_dir(model_dir, chat_template_name=chat_template_name)
        tokenizer.image_prompter = ImagePrompter.from_dir(model_dir)
        return tokenizer

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        max_num_tokens: int | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        if not any(IMAGE_SENTINEL in str(m.get("content", "")) for m in messages):
            return super().encode_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                continue_final_message=continue_final_message,
                max_num_tokens=max_num_tokens,
                **template_kwargs,
            )
        if continue_final_message:
            add_generation_prompt = False
        sentinels = [f"\x00{i}\x00" for i in range(len(messages))]
        rendered = self.apply_chat_template(
            [{**m, "content": s} for m, s in zip(messages, sentinels, strict=True)],
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **template_kwargs,
        )
        pieces: list[tuple[str, bool] | None] = []  # (text, is_literal) as encode_chat's; None: an image's slot
        for i, sentinel in enumerate(sentinels):
            head, _, rendered = rendered.partition(sentinel)
            pieces.append((head, False))
            for k, piece in enumerate(str(messages[i].get("content", "")).split(IMAGE_SENTINEL)):
                pieces += [None, (piece, True)] if k else [(piece, True)]
        if not continue_final_message:
            pieces.append((rendered, False))
        if max_num_tokens is not None:  # the slots only add tokens to the bound
            self._check_length([p for p in pieces if p is not None], max_num_tokens)
        slot = [self.image_prompter.image_token_id] * self.image_prompter.num_image_tokens
        ids: list[int] = []
        for p in pieces:
            ids += slot if p is None else self._encode_literal(p[0]) if p[1] else self.encode(p[0])
        return ids
