"""Build tiny Llama checkpoints in Hugging Face layout for tests and benchmarks.

Random weights from `transformers` (seeded), a byte-level BPE tokenizer trained with
`tokenizers` on a few KB of built-in text, the project's ChatML-style chat template and
EOS ids. Outputs are meaningless; they exist to check the engine against `transformers`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still answer a question.
What does the word river mean? A river is a large natural stream of water flowing to the sea.
Hello! How can I help you today? I am a tiny test model and my answers mean nothing.
Servers batch requests together so that many people can chat with one model at once.
Numbers like 1, 2, 3, 42 and 1024 appear in text; so do symbols: # $ % & * ( ) [ ] { }.
Caching the prefix of a prompt saves work when the next turn starts with the same history.
Ünïcödé text — café, naïve, 日本語, emoji 🙂 — must survive decoding byte by byte.
def add(a, b):\n    return a + b\n
The weather today is sunny with a light breeze from the west, and the sky is blue.
"""


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    initializer_range: float = 0.1  # larger than usual so greedy argmax has clear winners
    seed: int = 0
    rope_layout: str = "parameters"  # "parameters" (newer transformers) or "theta" (older)
    architecture: str = "llama"  # or "qwen2": the same layers plus biases on q, k and v
    thinking_tags: bool = False  # <think> and </think> as single tokens (not special: they decode), as Qwen3's


THINKING_TAGS = ("<think>", "</think>")


def train_tokenizer(vocab_size: int, text: str = _CORPUS, extra_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer with the chat special tokens (and `extra_tokens`, as added tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text] * 4, trainer=trainer)
    if extra_tokens:  # the trainer makes them special; as Qwen3's tags they are not (decoding keeps them)
        from tokenizers import Tokenizer as _Tokenizer

        data = json.loads(tok.to_str())
        for added in data["added_tokens"]:
            if added["content"] in extra_tokens:
                added["special"] = False
        tok = _Tokenizer.from_str(json.dumps(data))
    return tok


def write_tokenizer_files(path: Path, tok) -> int:
    """Write tokenizer.json and tokenizer_config.json; return the EOS id."""
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 1_000_000,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2), encoding="utf-8")
    return tok.token_to_id("<|im_end|>")


def build_tiny_llama(path: Path | str, spec: TinyModelSpec | None = None, **overrides) -> Path:
    """Write a random-weight Llama checkpoint folder at `path` and return it."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    if overrides:
        spec = TinyModelSpec(**{**_asdict(spec), **overrides})
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec.vocab_size, extra_tokens=THINKING_TAGS if spec.thinking_tags else ())
    eos_id = write_tokenizer_files(path, tok)
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[spec.architecture]
    config = config_class(
        vocab_size=tok.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        eos_token_id=eos_id,
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        bos_token_id=None,
    )
    torch.manual_seed(spec.seed)
    model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():  # transformers starts biases at zero, which would test nothing
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=spec.initializer_range)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(path, safe_serialization=True)
    if spec.rope_layout == "theta":
        _rewrite_rope_as_theta(path / "config.json", spec.rope_theta)
    return path


def _rewrite_rope_as_theta(config_file: Path, rope_theta: float) -> None:
    """Older transformers wrote `rope_theta` at the top level; emulate that layout."""
    cfg = json.loads(config_file.read_text(encoding="utf-8"))
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = rope_theta
    cfg["rope_scaling"] = None
    config_file.write_text(json.dumps(cfg, indent=2), encoding="utf-8")


def _asdict(spec: TinyModelSpec) -> dict:
    return {name: getattr(spec, name) for name in spec.__slots__}


# Qwen3.5's layout at a tiny size: three Gated DeltaNet layers to one attention layer, as the
# releases interleave them; two key heads shared by four value heads (the releases' grouping)
QWEN3_5_TINY = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def build_tiny_family(path: Path | str, model_type: str, *, seed: int = 0, tokenizer: bool = False, **config) -> Path:
    """A random-weight checkpoint of any served family, built with transformers' own config class.

    Norm weights and biases are moved away from their neutral start (ones, or zeros for Gemma's
    1 + weight) so that a norm or bias the engine skipped would change the output.
    """
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    eos_id, pad_id, vocab_size = 2, 0, config.pop("vocab_size", 512)
    if tokenizer:
        tok = train_tokenizer(vocab_size)
        eos_id, pad_id, vocab_size = (
            write_tokenizer_files(path, tok),
            tok.token_to_id("<|endoftext|>"),
            tok.get_vocab_size(),
        )
    defaults = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    if model_type == "gemma3":  # Gemma 3's 4B-and-up layout: the text model inside the multimodal one
        text = CONFIG_MAPPING["gemma3_text"](**{**defaults, **config})
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
        hf_config = CONFIG_MAPPING["gemma3"](
            text_config=text.to_dict(),
            vision_config={**vision, "patch_size": 14},
            mm_tokens_per_image=1,
            image_token_index=vocab_size - 1,
            boi_token_index=vocab_size - 3,
            eoi_token_index=vocab_size - 2,
            tie_word_embeddings=text.tie_word_embeddings,
        )
    elif model_type == "qwen3_5":  # Qwen3.5's releases: the text model inside the multimodal one
        text = CONFIG_MAPPING["qwen3_5_text"](**{**defaults, **config})
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14)
        hf_config = CONFIG_MAPPING["qwen3_5"](
            text_config=text.to_dict(),
            vision_config={**vision, "out_hidden_size": text.hidden_size},
            image_token_id=vocab_size - 1,
            video_token_id=vocab_size - 2,
            vision_start_token_id=vocab_size - 3,
            vision_end_token_id=vocab_size - 4,
            tie_word_embeddings=text.tie_word_embeddings,
        )
    elif model_type == "mistral3":  # Ministral 3's releases: the text model beside a Pixtral vision tower
        text = CONFIG_MAPPING["ministral3"](**{**defaults, **config})
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
        hf_config = CONFIG_MAPPING["mistral3"](
            text_config=text.to_dict(),
            vision_config={**vision, "image_size": 28, "patch_size": 14},
            image_token_index=vocab_size - 1,
            tie_word_embeddings=text.tie_word_embeddings,
        )
    else:
        hf_config = CONFIG_MAPPING[model_type](**{**defaults, **config})
    torch.manual_seed(seed)
    if model_type in ("qwen3_5", "mistral3"):
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(hf_config, dtype=torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norm weights and biases
                param.add_(torch.randn_like(param) * 0.1)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(path, safe_serialization=True)
    return path
