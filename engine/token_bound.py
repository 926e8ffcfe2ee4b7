"""A lower bound on a text's token count that costs far less than tokenizing it.

Owns the proof that a prompt cannot fit the context before its tokens are computed: a long
prompt's tokenization costs seconds of CPU and hundreds of MB, a bound on it one pass of the
normalizer. It never tokenizes and never decides what fits (the caller compares).

The bound, for a tokenizer whose every token covers at most `max_token_chars` characters of
normalized text and whose pipeline drops none (checked once at load, else no bound): the text
splits at its added tokens (one token each) into pieces that the `tokenizers` library
normalizes and tokenizes apart, so `num_tokens >= num_added + sum(ceil(len(normalize(piece))
/ max_token_chars))`. It holds for byte-level BPE (GPT-2, Llama 3, Qwen: a token covers at most
its length in bytes, which is at least its length in characters) and SentencePiece-style BPE
with byte fallback (Llama 2, Mistral); other models (Unigram, WordPiece) get no bound.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

# Pre-tokenizers that split or map text without dropping any of it (Whitespace, BertPreTokenizer
# and a Split with behavior "Removed" drop characters: a token count could be below the bound).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})


@dataclass(frozen=True, slots=True)
class TokenBound:
    max_token_chars: int  # the longest token of the vocabulary, added tokens included
    split: re.Pattern[str] | None  # the added tokens the library matches in raw text (leftmost-longest)
    literal_split: re.Pattern[str] | None  # the same without special tokens (encode_special_tokens)

    @classmethod
    def of(cls, tokenizer: HFTokenizer) -> TokenBound | None:
        """The bound of this tokenizer, or None where its pipeline may leave characters uncovered
        or let one token cover more than its length (then prompts are only counted exactly)."""
        spec = json.loads(tokenizer.to_str())
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        added = list(tokenizer.get_added_tokens_decoder().values())
        if any(t.lstrip or t.rstrip for t in added):  # such a token also takes the spaces around it
            return None
        if not _keeps_text(spec.get("pre_tokenizer")) or not _covers(spec.get("model") or {}, spec, vocab):
            return None
        raw = [t for t in added if t.content and not t.normalized and not t.single_word]
        return cls(
            max_token_chars=max((len(token) for token in vocab), default=1),
            split=_alternation(t.content for t in raw),
            literal_split=_alternation(t.content for t in raw if not t.special),
        )

    def min_num_tokens(self, tokenizer: HFTokenizer, text: str, *, is_literal: bool, stop_above: int) -> int:
        """A lower bound on `len(tokenizer.encode(text).ids)`, computed until it passes `stop_above`.
        `is_literal`: the tokenizer reads special-token text as plain text."""
        split = self.literal_split if is_literal else self.split
        total, start = 0, 0
        for match in split.finditer(text) if split is not None else ():
            total += 1 + self._piece_bound(tokenizer, text[start : match.start()])
            start = match.end()
            if total > stop_above:
                return total
        return total + self._piece_bound(tokenizer, text[start:])

    def _piece_bound(self, tokenizer: HFTokenizer, piece: str) -> int:
        if tokenizer.normalizer is not None and piece:
            piece = tokenizer.normalizer.normalize_str(piece)
        return -(-len(piece) // self.max_token_chars)


def _alternation(contents: Any) -> re.Pattern[str] | None:
    ordered = sorted(set(contents), key=len, reverse=True)  # the longest first: leftmost-longest
    return re.compile("|".join(re.escape(c) for c in ordered)) if ordered else None


def _pre_tokenizers(spec: dict | None) -> list[dict]:
    """The pre-tokenizer steps, a Sequence flattened."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [step for inner in spec.get("pretokenizers", ()) for step in _pre_tokenizers(inner)]
    return [spec]


def _keeps_text(pre_tokenizer: dict | None) -> bool:
    steps = _pre_tokenizers(pre_tokenizer)
    return all(p.get("type") in _KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed" for p in steps)


def _covers(model: dict, spec: dict, vocab: dict[str, int]) -> bool:
    """Whether BPE turns every character into tokens no longer than their text: no character
    dropped for want of a token, and no fused unknown token covering a run of them."""
    if model.get("type") != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return False
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True  # every character has byte tokens: <unk> is never emitted, fused or not (Llama 2, Mistral)
    if model.get("unk_token") is not None:
        return not model.get("fuse_unk")
    byte_level = any(p.get("type") == "ByteLevel" for p in _pre_tokenizers(spec.get("pre_tokenizer")))
    return byte_level and all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet())
