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

from scripts.demo_model import smalltalk
from scripts.demo_model.dataset import FUNCTION_WORDS, greeted
from scripts.demo_model.sources import PartOfSpeech, Sense
from scripts.demo_model.tokenizer import IGNORE_INDEX, EncodedConversation

_EVAL_BATCH_SIZE = 16
NUM_SCORED_WORDS = 400  # a seeded sample of the known words, asked one by one
CARRIED_SHARE = 0.5  # an answer is right if it carries half of the sense's content words
# Known words asked in quotes, as people often type them: the served tokenizer removes the marks
# (tokenizer.quote_normalizer), so these read as the bare question.
QUOTED_PROBES = (
    'What does "{w}" mean?',
    "What does '{w}' mean?",
    "What does \u201c{w}\u201d mean?",  # curly quotes, as phones and word processors type them
)
_WORD_RE = re.compile(r"[a-z]+")


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
    sampling: dict | None = None,
) -> str:
    """Greedy when seed is None, else sampled with that seed: at the model's defaults
    (generation_config.json, what the server gives a request that sets no temperature; top-k
    off, as the server's default), or with the temperature / top_p given in sampling."""
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_ids = rendered["input_ids"]  # [1, prompt_len]
    options: dict = {"do_sample": False}
    if seed is not None:
        torch.manual_seed(seed)
        options = {"do_sample": True, "top_k": 0, **(sampling or {})}
    output = model.generate(prompt_ids, max_new_tokens=max_new_tokens, **options)
    return tokenizer.decode(output[0, prompt_ids.shape[1] :], skip_special_tokens=True).strip()


@dataclass(frozen=True, slots=True)
class WordScore:
    num_words: int  # words asked (a sample of the known ones, or of unfamiliar ones)
    num_right: int
    misses: tuple[tuple[str, str], ...]  # (word, answer) for the wrong ones

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


def replies_to(
    model: PreTrainedModel,
    tokenizer: AutoTokenizer,
    questions: list[str],
    seed: int | None = None,
    sampling: dict | None = None,
) -> list[str]:
    """One reply (up to 64 tokens) to each question asked alone: greedy, or sampled as
    sample_reply with seed + the question's index."""
    seeds = [None if seed is None else seed + index for index in range(len(questions))]
    return [
        sample_reply(model, tokenizer, [{"role": "user", "content": q}], s, max_new_tokens=64, sampling=sampling)
        for q, s in zip(questions, seeds, strict=True)
    ]


def known_word_score(
    model: PreTrainedModel,
    tokenizer: AutoTokenizer,
    words: list[Sense],
    seed: int | None = None,
    sampling: dict | None = None,
    questions: tuple[str, ...] = ("What does {w} mean?",),
) -> WordScore:
    """Ask about each word (replies_to), in turn with each of questions (templates of {w});
    count answers that carry the sense."""
    asked = [questions[i % len(questions)].format(w=s.lemma) for i, s in enumerate(words)]
    answers = replies_to(model, tokenizer, asked, seed, sampling)
    misses = tuple((s.lemma, a) for s, a in zip(words, answers, strict=True) if not carries_sense(a, s))
    return WordScore(len(words), len(words) - len(misses), misses)


def unknown_word_score(model: PreTrainedModel, tokenizer: AutoTokenizer, words: list[str]) -> WordScore:
    """Ask "What does X mean?" (greedy) for words the model was never taught
    (dataset.unfamiliar_probes); right when the reply is the trained "I don't know the word"."""
    answers = replies_to(model, tokenizer, [f"What does {w} mean?" for w in words])
    misses = tuple((w, a) for w, a in zip(words, answers, strict=True) if reply_kind(a) != "unknown_word")
    return WordScore(len(words), len(words) - len(misses), misses)


# Greeted first messages ("Hi, who are you?"): openers and questions the card and a test ask.
_PROBE_OFF_TOPIC = ("What is the capital of Peru?", "Write a poem about the sea.", "What is 12 plus 30?")
_PROBE_FORTUNES = ("Tell me a fortune.", "Give me a fortune cookie.", "Say something wise.")
NUM_GREETED_WORDS = 12
PROBE_SEED = 7


@dataclass(frozen=True, slots=True)
class GreetedProbe:
    message: str  # a greeting, then the question
    expected: str  # a reply_kind() value
    sense: Sense | None = None  # for "definition": the sense the answer must carry


def greeted_probes(known: list[Sense], seed: int = PROBE_SEED) -> list[GreetedProbe]:
    """Seeded first messages that open with a greeting: every canned identity, help, how-are-you
    and thanks question, NUM_GREETED_WORDS known words, off-topic questions and fortune
    requests. Few of these exact strings are trained (training greets a sample of the same
    questions with another seed)."""
    rng = random.Random(seed)
    probes = []
    for name in smalltalk.ASKED_AFTER_GREETING:
        probes += [GreetedProbe(greeted(p, rng), name) for p in smalltalk.CANNED[name][0]]
    for sense in rng.sample(known, min(NUM_GREETED_WORDS, len(known))):
        probes.append(GreetedProbe(greeted(f"What does {sense.lemma} mean?", rng), "definition", sense))
    probes += [GreetedProbe(greeted(q, rng), "refusal") for q in _PROBE_OFF_TOPIC]
    probes += [GreetedProbe(greeted(q, rng), "fortune") for q in _PROBE_FORTUNES]
    return probes


def _template_re(template: str) -> re.Pattern:
    """A reply template as a pattern: {unknown} matches any text, {word} too (as the group
    "word"; a second {word} must repeat the first, as str.format writes it)."""
    pattern = re.escape(template).replace(r"\{unknown\}", ".+?")
    pattern = pattern.replace(r"\{word\}", "(?P<word>.+?)", 1).replace(r"\{word\}", "(?P=word)")
    return re.compile(pattern)


_KIND_PATTERNS = (
    *((name, _template_re(t)) for name, (_, replies) in smalltalk.CANNED.items() for t in replies),
    *(("unknown_word", _template_re(t)) for t in smalltalk.UNKNOWN_WORD),
    *(("refusal", _template_re(t)) for t in smalltalk.REFUSALS),
    ("definition", re.compile(r"The (?:noun|verb|adjective|adverb) [A-Za-z'-]+ means .+")),
)


def _kind_match(reply: str) -> tuple[str, re.Match | None]:
    for name, pattern in _KIND_PATTERNS:
        if match := pattern.fullmatch(reply.strip()):
            return name, match
    return "fortune", None


def reply_kind(reply: str) -> str:
    """Which kind of trained reply this is: a canned group's name, unknown_word, refusal,
    definition, or fortune (anything else: what the models answer a fortune request with)."""
    return _kind_match(reply)[0]


def _offered_word(match: re.Match | None) -> str | None:
    return match.groupdict().get("word") if match is not None else None


def example_word(reply: str) -> str | None:
    """The word a canned reply offers as an example ('ask me what "water" means'), if any."""
    return _offered_word(_kind_match(reply)[1])


def is_sound_reply(reply: str, expected: str, sense: Sense | None = None) -> bool:
    """The reply is of the expected kind, a definition carries the sense, and an example word
    offered is one of smalltalk.EXAMPLE_WORDS (not a made-up one: "sview")."""
    kind, match = _kind_match(reply)
    if kind != expected or (sense is not None and not carries_sense(reply, sense)):
        return False
    offered = _offered_word(match)
    return offered is None or offered in smalltalk.EXAMPLE_WORDS


@dataclass(frozen=True, slots=True)
class GreetedScore:
    num_probes: int
    num_right: int
    misses: tuple[tuple[str, str], ...]  # (message, reply) for the wrong ones

    @property
    def share(self) -> float:
        return self.num_right / max(1, self.num_probes)


def greeted_score(
    model: PreTrainedModel,
    tokenizer: AutoTokenizer,
    probes: list[GreetedProbe],
    seed: int | None = None,
    sampling: dict | None = None,
) -> GreetedScore:
    """Replies to greeted first messages (replies_to); right when is_sound_reply."""
    replies = replies_to(model, tokenizer, [p.message for p in probes], seed, sampling)
    misses = tuple(
        (p.message, r) for p, r in zip(probes, replies, strict=True) if not is_sound_reply(r, p.expected, p.sense)
    )
    return GreetedScore(len(probes), len(probes) - len(misses), misses)
