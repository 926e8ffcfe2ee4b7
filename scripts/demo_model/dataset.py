"""Turns WordNet senses, fortunes and canned small talk into chat conversations, splits them
into train and held-out sets, and reads/writes them as JSON lines. Deterministic for a given
seed; the held-out split is keyed by a hash of the word or fortune, not by sampling order.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from scripts.demo_model import smalltalk
from scripts.demo_model.sources import PartOfSpeech, Sense

HELDOUT_PERCENT = 3
NUM_RARE_WORDS = 8000  # untagged (rare) WordNet lemmas sampled beside all SemCor-tagged ones
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly assistant. Answer briefly.",
    "You are a small demo model.",
    "Be concise.",
)
_QUESTIONS = (  # weights: the canonical phrasing dominates so the small model locks onto it
    ("What does {w} mean?", 8),
    ("What does the word {w} mean?", 2),
    ('What does "{w}" mean?', 2),
    ("What is the meaning of {w}?", 2),
    ("Define {w}.", 2),
    ("define {w}", 1),
    ("What's the definition of {w}?", 1),
    ("Can you tell me what {w} means?", 1),
    ("Explain the word {w}.", 1),
    ("meaning of {w}", 1),
    ("{w}?", 1),
    ("I don't know what {w} means.", 1),
)
_FORTUNE_PROMPTS = (
    "Tell me a fortune.",
    "Give me a fortune.",
    "Tell me a quote.",
    "Say something wise.",
    "Tell me something interesting.",
    "Share a saying with me.",
    "I need some wisdom.",
    "Give me a fortune cookie.",
    "fortune",
    "Cheer me up.",
    "Tell me a joke.",
)
_DEFINITION_RE = re.compile(r"The (noun|verb|adjective|adverb) [a-z]+ means ")


class Split(Enum):
    TRAIN = "train"
    HELDOUT = "heldout"


@dataclass(frozen=True, slots=True)
class Conversation:
    source: str  # definition | example | synonym | fortune | smalltalk | off_topic
    messages: tuple[tuple[str, str], ...]  # (role, content), roles as in the chat template

    def to_json(self) -> str:
        messages = [{"role": role, "content": content} for role, content in self.messages]
        return json.dumps({"source": self.source, "messages": messages}, ensure_ascii=False)

    @staticmethod
    def from_json(line: str) -> Conversation:
        row = json.loads(line)
        return Conversation(row["source"], tuple((m["role"], m["content"]) for m in row["messages"]))


def split_of(key: str) -> Split:
    return Split.HELDOUT if zlib.crc32(key.encode()) % 100 < HELDOUT_PERCENT else Split.TRAIN


def choose_senses(senses: list[Sense], rng: random.Random) -> list[Sense]:
    """One sense per lemma (the POS with most tagged senses); tagged lemmas plus a rare sample."""
    best: dict[str, Sense] = {}
    for sense in senses:  # POS order noun, verb, adj, adv breaks ties
        current = best.get(sense.lemma)
        if current is None or sense.num_tagged_senses > current.num_tagged_senses:
            best[sense.lemma] = sense
    common = [s for s in best.values() if s.num_tagged_senses > 0]
    rare = [s for s in best.values() if s.num_tagged_senses == 0]
    return common + rng.sample(rare, min(NUM_RARE_WORDS, len(rare)))


def build_conversations(senses: list[Sense], fortunes: list[str], seed: int) -> dict[Split, list[Conversation]]:
    """Every item is first built single-turn with its split key; some are then chained into
    multi-turn chats within the same split, and some get a system prompt."""
    rng = random.Random(seed)
    chosen = choose_senses(senses, rng)
    common_words = [s.lemma for s in chosen if s.num_tagged_senses >= 3]
    keyed: list[tuple[str, Conversation]] = []  # (split key, conversation)
    for sense in chosen:
        keyed += [(sense.lemma, c) for c in _word_conversations(sense, rng)]
    for fortune in fortunes:
        keyed.append((fortune, _single("fortune", _vary(rng.choice(_FORTUNE_PROMPTS), rng), fortune)))
    keyed.extend(_smalltalk(common_words, rng))
    splits: dict[Split, list[Conversation]] = {Split.TRAIN: [], Split.HELDOUT: []}
    for key, conversation in keyed:
        splits[split_of(key)].append(conversation)
    return {split: _chain_and_prompt(items, rng) for split, items in splits.items()}


def _word_conversations(sense: Sense, rng: random.Random) -> list[Conversation]:
    """Always a definition; sometimes an example sentence or a synonym question too."""
    question = _definition_question(sense.lemma, sense.pos, rng)
    conversations = [_single("definition", question, definition_answer(sense))]
    if sense.examples and rng.random() < 0.3:
        question = _vary(f"Use {sense.lemma} in a sentence.", rng)
        conversations.append(_single("example", question, _example_answer(sense)))
    one_word_synonyms = [w for w in sense.synonyms if " " not in w]
    if one_word_synonyms and rng.random() < 0.2:
        question = _vary(f"What is another word for {sense.lemma}?", rng)
        conversations.append(_single("synonym", question, _synonym_answer(sense.lemma, one_word_synonyms)))
    return conversations


def definition_answer(sense: Sense) -> str:
    # "The noun dog means ..." rather than 'The word "dog" ...': after a space the word is the
    # same token as in the question, which a tiny model can copy far more easily.
    meaning = sense.definition
    if sense.pos is PartOfSpeech.VERB and not meaning.startswith("to "):
        meaning = f"to {meaning}"
    text = f"The {sense.pos.value} {sense.lemma} means {_sentence_end(meaning)}"
    if sense.examples:
        text += f' For example: "{_sentence_end(_capitalise(sense.examples[0]))}"'
    return text


def count_definitions(conversations: list[Conversation]) -> int:
    return sum(
        1
        for c in conversations
        for role, content in c.messages
        if role == "assistant" and _DEFINITION_RE.match(content)
    )


def _definition_question(lemma: str, pos: PartOfSpeech, rng: random.Random) -> str:
    templates = [t for t, _ in _QUESTIONS] + (["What is a {w}?"] if pos is PartOfSpeech.NOUN else [])
    weights = [w for _, w in _QUESTIONS] + ([2] if pos is PartOfSpeech.NOUN else [])
    template = rng.choices(templates, weights=weights)[0]
    if template == "What is a {w}?" and lemma[0] in "aeiou":
        template = "What is an {w}?"
    return _vary(template.format(w=lemma), rng)


def _example_answer(sense: Sense) -> str:
    return f'Here is an example: "{_sentence_end(_capitalise(sense.examples[0]))}"'


def _synonym_answer(lemma: str, synonyms: list[str]) -> str:
    if len(synonyms) == 1:
        return f"Another word for {lemma} is {synonyms[0]}."
    return f"Some other words for {lemma} are {', '.join(synonyms[:3])}."


def _smalltalk(common_words: list[str], rng: random.Random) -> list[tuple[str, Conversation]]:
    keyed = []
    for phrasings, replies in smalltalk.CANNED_GROUPS:
        for phrasing in phrasings:
            for _ in range(12):  # each phrasing seen with several replies and example words
                reply = rng.choice(replies).format(word=rng.choice(common_words))
                # Canned turns are keyed by phrasing: a few phrasings stay unseen for held-out.
                keyed.append((phrasing, _single("smalltalk", _vary(phrasing, rng), reply)))
    for index in range(1200):
        question = smalltalk.off_topic_question(rng)
        reply = rng.choice(smalltalk.REFUSALS).format(word=rng.choice(common_words))
        keyed.append((f"off_topic-{index}", _single("off_topic", _vary(question, rng), reply)))
    return keyed


def _chain_and_prompt(items: list[Conversation], rng: random.Random) -> list[Conversation]:
    """Shuffle, join about 15% into 2-3 turn chats, and prefix about 10% with a system prompt."""
    rng.shuffle(items)
    chained: list[Conversation] = []
    index = 0
    while index < len(items):
        num_turns = rng.choice((2, 3)) if rng.random() < 0.15 else 1
        group = items[index : index + num_turns]
        index += num_turns
        messages = tuple(m for conversation in group for m in conversation.messages)
        if rng.random() < 0.1:
            messages = (("system", rng.choice(_SYSTEM_PROMPTS)),) + messages
        source = group[0].source if len(group) == 1 else "multi_turn"
        chained.append(Conversation(source, messages))
    return chained


def _single(source: str, question: str, answer: str) -> Conversation:
    return Conversation(source, (("user", question), ("assistant", answer)))


def _vary(text: str, rng: random.Random) -> str:
    """Users type sloppily: sometimes lowercase, sometimes without the final punctuation."""
    roll = rng.random()
    if roll < 0.15:
        return text.lower()
    if roll < 0.25:
        return text.rstrip(".?!")
    return text


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def _sentence_end(text: str) -> str:
    return text if text[-1:] in ".!?" else f"{text}."


def write_jsonl(path: Path, conversations: list[Conversation]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(c.to_json() + "\n" for c in conversations), encoding="utf-8")


def read_jsonl(path: Path) -> list[Conversation]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Conversation.from_json(line) for line in lines if line]
