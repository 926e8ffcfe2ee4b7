"""Measures a demo model: held-out loss and perplexity over assistant tokens, how many of the
words it claims to know it defines right (greedy), and sample replies generated with
transformers from a saved model directory (the same files the server loads). No training and no
file writing here.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from scripts.demo_model.dataset import FUNCTION_WORDS
from scripts.demo_model.sources import PartOfSpeech, Sense
from scripts.demo_model.tokenizer import IGNORE_INDEX, EncodedConversation

_EVAL_BATCH_SIZE = 16
NUM_SCORED_WORDS = 400  # a seeded sample of the known words, asked one by one
CARRIED_SHARE = 0.5  # an answer is right if it carries half of the sense's content words
_WORD_RE = re.compile(r"[a-z]+")


@dataclass(frozen=True, slots=True)
class SampleReply:
    prompt: str
    reply: str
    is_sampled: bool  # False: greedy decoding


@torch.no_grad()
def heldout_loss(model: PreTrainedModel, encoded: list[EncodedConversation]) -> float:
    """Mean negative log-likelihood (nats) per assistant token, each conversation on its own
    from position 0, as at serving time."""
    model.eval()
    total_nll = 0.0
    num_tokens = 0
    for start in range(0, len(encoded), _EVAL_BATCH_SIZE):
        chunk = encoded[start : start + _EVAL_BATCH_SIZE]
        length = max(len(c.input_ids) for c in chunk)
        # Right padding: with causal attention the pads cannot change earlier positions.
        input_ids = torch.tensor([list(c.input_ids) + [0] * (length - len(c.input_ids)) for c in chunk])
        labels = torch.tensor([list(c.labels) + [IGNORE_INDEX] * (length - len(c.labels)) for c in chunk])
        logits = model(input_ids=input_ids).logits.float()  # [batch, length, vocab]
        total_nll += float(
            torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        )
        num_tokens += int((labels[:, 1:] != IGNORE_INDEX).sum())
    return total_nll / max(1, num_tokens)


def perplexity(loss_nats: float) -> float:
    return math.exp(loss_nats)


def load_for_eval(model_dir: Path) -> tuple[PreTrainedModel, AutoTokenizer]:
    """The saved 16-bit weights upcast to fp32, as the engine does on CPU."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def sample_reply(
    model: PreTrainedModel,
    tokenizer: AutoTokenizer,
    messages: list[dict],
    seed: int | None = None,
    max_new_tokens: int = 96,
) -> str:
    """Greedy when seed is None, else temperature 0.7 / top-p 0.9 sampling with that seed."""
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_ids = rendered["input_ids"]  # [1, prompt_len]
    options: dict = {"do_sample": False}
    if seed is not None:
        torch.manual_seed(seed)
        options = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0}
    output = model.generate(prompt_ids, max_new_tokens=max_new_tokens, **options)
    return tokenizer.decode(output[0, prompt_ids.shape[1] :], skip_special_tokens=True).strip()


@dataclass(frozen=True, slots=True)
class KnownWordScore:
    num_words: int  # words asked (a sample of the known ones)
    num_right: int
    misses: tuple[tuple[str, str], ...]  # (word, greedy answer) for the wrong ones

    @property
    def share(self) -> float:
        return self.num_right / max(1, self.num_words)


def read_known_words(path: Path) -> list[Sense]:
    """known_words.jsonl rows ({"lemma", "pos", "definition"}) as senses (no examples)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [Sense(r["lemma"], PartOfSpeech(r["pos"]), r["definition"], (), (), 0) for r in rows]


def content_words(text: str, lemma: str = "") -> set[str]:
    """Lowercase words of text, function words and the defined word itself left out."""
    return {w for w in _WORD_RE.findall(text.lower()) if w not in FUNCTION_WORDS and w != lemma}


def carries_sense(answer: str, sense: Sense) -> bool:
    """True if the answer holds at least CARRIED_SHARE of the definition's content words."""
    wanted = content_words(sense.definition, sense.lemma)
    if not wanted:
        return True
    return len(wanted & content_words(answer)) >= CARRIED_SHARE * len(wanted)


def scored_sample(known: list[Sense], seed: int) -> list[Sense]:
    return random.Random(seed).sample(known, min(NUM_SCORED_WORDS, len(known)))


def known_word_score(model: PreTrainedModel, tokenizer: AutoTokenizer, words: list[Sense]) -> KnownWordScore:
    """Ask "What does X mean?" greedily for each word; count answers that carry the sense."""
    misses = []
    for sense in words:
        messages = [{"role": "user", "content": f"What does {sense.lemma} mean?"}]
        answer = sample_reply(model, tokenizer, messages, max_new_tokens=64)
        if not carries_sense(answer, sense):
            misses.append((sense.lemma, answer))
    return KnownWordScore(len(words), len(words) - len(misses), tuple(misses))
