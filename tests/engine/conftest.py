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

from testing.tiny_model import build_tiny_family, build_tiny_llama

VARIANTS = {
    "tied-gqa-parameters": dict(tie_word_embeddings=True, num_key_value_heads=2, rope_layout="parameters"),
    "untied-gqa-theta": dict(tie_word_embeddings=False, num_key_value_heads=2, rope_layout="theta", seed=1),
    "untied-mha-parameters": dict(tie_word_embeddings=False, num_key_value_heads=4, seed=2),
    "tied-gqa-llama3-rope": dict(num_key_value_heads=1, seed=3, rope_theta=500000.0),
    "qwen2-qkv-bias": dict(architecture="qwen2", tie_word_embeddings=False, num_key_value_heads=2, seed=4),
}


SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
# One checkpoint per served family (transformers' own config class), small enough to test in
# seconds, with every feature the family adds switched on at a size that changes the output.
FAMILY_VARIANTS = {
    "qwen3": dict(model_type="qwen3", head_dim=32, seed=10),
    "gemma3": dict(
        model_type="gemma3_text", head_dim=16, num_hidden_layers=3, layer_types=SLIDING, sliding_window=24,
        query_pre_attn_scalar=20, final_logit_softcapping=5.0, seed=11,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
    ),
    "gemma2": dict(
        model_type="gemma2", head_dim=16, num_hidden_layers=3, layer_types=SLIDING, sliding_window=24,
        query_pre_attn_scalar=20, attn_logit_softcapping=3.0, final_logit_softcapping=5.0, seed=12,
    ),
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5, sliding_window=40, seed=13),
    "phi3-longrope": dict(
        model_type="phi3", seed=14, original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + i / 10 for i in range(6)], "long_factor": [2.0 + i for i in range(6)],
        },
    ),
    "smollm3": dict(model_type="smollm3", num_hidden_layers=3, no_rope_layer_interval=2, seed=15),
    "mistral-sliding": dict(model_type="mistral", sliding_window=24, head_dim=16, seed=16),
    "granite": dict(
        model_type="granite", embedding_multiplier=4.0, attention_multiplier=0.3, residual_multiplier=0.6,
        logits_scaling=2.5, seed=17,
    ),
    "olmo2": dict(model_type="olmo2", seed=18),
    "llama-yarn": dict(
        model_type="llama", seed=19,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    ),
    "llama-dynamic": dict(
        model_type="llama", seed=20, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    ),
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
            from transformers import AutoModelForCausalLM

            self._hf[variant] = AutoModelForCausalLM.from_pretrained(self.path(variant), dtype=torch.float32).eval()
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
