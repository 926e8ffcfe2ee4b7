"""The demo models' shared byte-level BPE tokenizer and ChatML chat format: training it with
`tokenizers`, writing the Hugging Face tokenizer files, and turning a conversation into token
ids plus loss labels (assistant replies only). Knows nothing about models or training.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from scripts.demo_model.dataset import Conversation

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (IM_START, IM_END, PAD)  # ids 0, 1, 2
# The project-wide chat template: keep byte-identical with the engine's and the tests' copies.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IGNORE_INDEX = -100  # label value that torch's cross-entropy skips
# Quote marks around words, as users type them ('What does "friend" mean?'), in straight and curly
# forms: (opening, closing). A quoted word is another token than the bare one (' "friend' reads
# as ' "' + 'friend', where 'What does friend mean?' has ' friend'), and the tiny demo models
# answered 13-14 of 100 known words asked in quotes right. The served tokenizer drops such
# marks before the model reads the text (`quote_normalizer`).
_QUOTES = (('"', '"'), ("'", "'"), ("\u201c", "\u201d"), ("\u2018", "\u2019"))
_WORD_END = r"(?=[\s?.!,;:)]|$)"


def quote_normalizer() -> normalizers.Normalizer:
    """Removes quote marks around words: an opening mark at the start of a line or after a space
    or "(", before a letter, when its closing mark follows on the same line within 60 characters;
    and a closing mark after a letter, before a space, punctuation or the end. Apostrophes inside
    words ("don't", "it\u2019s") stay; a plural possessive's ("the students' books") goes."""
    patterns = []
    for opening, closing in _QUOTES:
        close = f"{closing}{_WORD_END}" if closing in ("'", "\u2019") else closing  # not "don't"
        patterns.append(rf"(?<=^|[\s(]){opening}(?=\p{{L}}[^{closing}\n]{{0,60}}{close})")
    patterns += [rf"(?<=\p{{L}}){closing}{_WORD_END}" for closing in dict.fromkeys(c for _, c in _QUOTES)]
    return normalizers.Sequence([normalizers.Replace(Regex(p), "") for p in patterns])


@dataclass(frozen=True, slots=True)
class EncodedConversation:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]  # token id where the model is trained to predict it, else -100


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Byte level, so any user input (emoji, accents) still encodes and decodes losslessly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def conversation_texts(conversations: Iterable[Conversation]) -> Iterable[str]:
    """The text the chat template wraps around special tokens, one string per message."""
    for conversation in conversations:
        for role, content in conversation.messages:
            yield f"{role}\n{content}"


def save_tokenizer_files(tokenizer: Tokenizer, model_dir: Path, max_length: int, *, served: bool = True) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json (HF layout). `served`:
    with `quote_normalizer` (the files next to a model); the build trains without it."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: the caller's keeps its normalizer
    tokenizer.normalizer = quote_normalizer() if served else None
    tokenizer.save(str(model_dir / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(model_dir / "tokenizer_config.json", config)
    _write_json(model_dir / "special_tokens_map.json", {"eos_token": IM_END, "pad_token": PAD})


def encode_conversation(tokenizer: Tokenizer, conversation: Conversation) -> EncodedConversation:
    """Token ids equal to encoding the rendered chat template with the training tokenizer (a
    served tokenizer's normalizer is left out: losses are measured on what the models were
    trained on); labels cover each assistant reply and its closing <|im_end|> (what the model
    must learn to produce, and stop on)."""
    normalizer = tokenizer.normalizer
    tokenizer.normalizer = None
    try:
        return _encode_conversation(tokenizer, conversation)
    finally:
        tokenizer.normalizer = normalizer


def _encode_conversation(tokenizer: Tokenizer, conversation: Conversation) -> EncodedConversation:
    im_start, im_end = tokenizer.token_to_id(IM_START), tokenizer.token_to_id(IM_END)
    newline = tokenizer.encode("\n").ids
    input_ids: list[int] = []
    labels: list[int] = []
    for role, content in conversation.messages:
        header = [im_start] + tokenizer.encode(f"{role}\n").ids
        body = tokenizer.encode(content).ids + [im_end]
        is_trained = role == "assistant"
        input_ids += header + body + newline
        labels += [IGNORE_INDEX] * len(header)
        labels += body if is_trained else [IGNORE_INDEX] * len(body)
        labels += [IGNORE_INDEX] * len(newline)
    return EncodedConversation(tuple(input_ids), tuple(labels))


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
