"""Build a tiny random-weight LLaVA checkpoint (CLIP vision tower + projector + Llama) for tests.

The folder has what a real one has: config.json (`model_type: llava`), model.safetensors
written by `transformers`, a tokenizer with an `<image>` token and a chat template that
places it, and preprocessor_config.json for CLIP-style preprocessing.
"""

from __future__ import annotations

import json
from pathlib import Path

from testing.tiny_model import train_tokenizer

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_llava(path: Path | str, *, image_size: int = 32, patch_size: int = 8, seed: int = 0) -> Path:
    import torch
    from transformers import CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(512)
    tok.add_special_tokens([IMAGE_TOKEN])
    tok.save(str(path / "tokenizer.json"))
    eos_id = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": 1_000_000,
            },
            indent=2,
        )
    )
    text = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
        eos_token_id=eos_id,
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        bos_token_id=None,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
        initializer_range=0.1,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.token_to_id(IMAGE_TOKEN),
        image_seq_length=(image_size // patch_size) ** 2,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # larger random weights than the defaults, so greedy argmax has clear winners
        for name, param in model.named_parameters():
            if ("vision_tower" in name or "projector" in name) and (param.dim() > 1 or name.endswith(".bias")):
                param.normal_(std=0.2 if param.dim() > 1 else 0.05)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=text.pad_token_id)
    model.save_pretrained(path, safe_serialization=True)
    (path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "CLIPImageProcessor",
                "do_resize": True,
                "size": {"shortest_edge": image_size},
                "resample": 3,
                "do_center_crop": True,
                "crop_size": {"height": image_size, "width": image_size},
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "do_convert_rgb": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
            },
            indent=2,
        )
    )
    return path
