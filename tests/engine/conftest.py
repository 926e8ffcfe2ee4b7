"""Tiny checkpoints for the native-engine tests, built once per session, and their references.

Variants cover what the loader must handle: tied and untied embeddings, GQA and plain
multi-head attention, RoPE settings as `rope_parameters` or as top-level `rope_theta`,
llama3-style RoPE scaling, and Qwen2 (biases on q, k and v); FAMILY_VARIANTS has one
checkpoint per other served family. `transformers` runs the same weights as the reference.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from family_variants import FAMILY_VARIANTS
from testing.tiny_model import build_tiny_family, build_tiny_llama

VARIANTS = {
    "tied-gqa-parameters": dict(tie_word_embeddings=True, num_key_value_heads=2, rope_layout="parameters"),
    "untied-gqa-theta": dict(tie_word_embeddings=False, num_key_value_heads=2, rope_layout="theta", seed=1),
    "untied-mha-parameters": dict(tie_word_embeddings=False, num_key_value_heads=4, seed=2),
    "tied-gqa-llama3-rope": dict(num_key_value_heads=1, seed=3, rope_theta=500000.0),
    "qwen2-qkv-bias": dict(architecture="qwen2", tie_word_embeddings=False, num_key_value_heads=2, seed=4),
}


def _add_llama3_rope_scaling(model_dir: Path) -> None:
    cfg_file = model_dir / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg_file.write_text(json.dumps(cfg, indent=2))


class TinyModels:
    """Builds a variant on first use; keeps the transformers reference model per variant."""

    def __init__(self, root: Path):
        self.root = root
        self._dirs: dict[str, Path] = {}
        self._hf: dict[str, object] = {}
        self._greedy: dict[tuple, list[int]] = {}

    def path(self, variant: str) -> Path:
        if variant in FAMILY_VARIANTS and variant not in self._dirs:
            self._dirs[variant] = build_tiny_family(self.root / variant, **FAMILY_VARIANTS[variant])
        if variant not in self._dirs:
            model_dir = build_tiny_llama(self.root / variant, **VARIANTS[variant])
            if variant.endswith("llama3-rope"):
                _add_llama3_rope_scaling(model_dir)
            self._dirs[variant] = model_dir
        return self._dirs[variant]

    def reference(self, variant: str):
        if variant not in self._hf:
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

            # Mistral 3 has no causal-LM class of its own: its multimodal one, given text only
            multimodal = json.loads((self.path(variant) / "config.json").read_text())["model_type"] == "mistral3"
            auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
            # Eager attention: the plain formula in every transformers version. Before 5.23 the
            # default (SDPA) silently skipped Gemma 2's attention-logit soft-cap, which made the
            # reference, not the engine, wrong (seen on a GPU host's transformers 5.17).
            self._hf[variant] = auto.from_pretrained(
                self.path(variant), dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return self._hf[variant]

    def greedy(self, variant: str, prompt: list[int], max_tokens: int, eos_token_id: int | None) -> list[int]:
        """transformers' greedy continuation (EOS included when it stops there)."""
        key = (variant, tuple(prompt), max_tokens, eos_token_id)
        if key not in self._greedy:
            self._greedy[key] = self._generate(variant, prompt, max_tokens, eos_token_id)
        return self._greedy[key]

    def _generate(self, variant: str, prompt: list[int], max_tokens: int, eos_token_id: int | None) -> list[int]:
        model = self.reference(variant)
        config = copy.deepcopy(model.generation_config)
        config.max_new_tokens, config.do_sample, config.pad_token_id = max_tokens, False, 0
        # None would fall back to the model's EOS; an id past the vocabulary never stops it.
        config.eos_token_id = eos_token_id if eos_token_id is not None else 10**9
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                generation_config=config,
            )
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("native-engine-models"))
