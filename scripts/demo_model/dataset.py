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
# The words the models know: of the most frequent English words (wordfreq's list), those with a
# WordNet sense. All of them are trained (none held out), each asked more than once.
NUM_FREQUENT_WORDS = 3_000
NUM_DEFINITION_QUESTIONS = 3  # definition conversations per known word (different phrasings)
# Words outside the known list teach "I don't know that word": NUM_LESS_COMMON_UNKNOWN less
# common words (frequency ranks UNFAMILIAR_FROM_RANK to RARE_FROM_RANK, such as "yowl") and
# rare WordNet lemmas beyond them for the rest. A hashed few percent of each band are held out,
# never trained; the build asks the models about them (unfamiliar_probes). With 1,000 rare words
# only (the builds before 2026-11-26) the models admitted 47-51 of 100 held-out less common
# words and 76-77 of 100 rarer ones; with these 2,000 (and more off-topic and foreign-language
# data to keep odd first messages declined, NUM_OFF_TOPIC, SMALLTALK_COPIES) 62-65 and 80-84.
NUM_UNKNOWN_WORDS = 2000
NUM_LESS_COMMON_UNKNOWN = 1000
UNFAMILIAR_FROM_RANK = 4_000
RARE_FROM_RANK = 60_000
NUM_FORTUNES = 300  # a hashed sample: any fortune is a fine answer, so few are needed
NUM_OFF_TOPIC = 1800  # questions the models should decline (smalltalk.off_topic_question)
# English function words: left out of the known words (WordNet's first sense of "are" is a unit
# of area, of "can" a verb for canning food) and ignored when an answer is scored.
FUNCTION_WORDS = frozenset(
    """a about above after again against all also am an and any are as at be because been before
    being below between both but by can could did do does doing down during each either else ever
    few for from further had has have having he her here hers herself him himself his how however
    i if in into is it its itself just let like may me might mine more most must my myself neither
    no nor not now of off often on once one only or other ought our ours ourselves out over own
    per quite rather same shall she should since so some such than that the their theirs them
    themselves then there these they this those though through thus to too under until up upon us
    very was we were what when where whether which while who whom whose why will with within
    without would yet you your yours yourself yourselves""".split()
)
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
    ("What does '{w}' mean?", 1),
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
_SYNONYM_QUESTIONS = ("What is another word for {w}?", "synonym for {w}", "What is a synonym for {w}?")
_SYNONYM_WEIGHTS = (4, 1, 1)
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
# People often open a chat with a greeting and their question in one message ("Hi, who are
# you?"). The canned questions are each asked this many more times after a greeting, and this
# share of the word, fortune and off-topic questions once more; the greetings come from their
# own seeded generator, so the rest of the data is drawn as before.
SMALLTALK_COPIES = 8  # each canned phrasing is trained this often, with several replies and example words
GREETED_PER_PHRASING = 3
GREETED_SHARE = 0.1
_GREETING_SEPARATORS = (", ", "! ", ". ", " ")
_DEFINITION_RE = re.compile(r"The (noun|verb|adjective|adverb) [a-z]+ means ")


class Split(Enum):
    TRAIN = "train"
    HELDOUT = "heldout"


@dataclass(frozen=True, slots=True)
class Conversation:
    source: str  # definition | example | synonym | unknown_word | fortune | smalltalk | off_topic
    messages: tuple[tuple[str, str], ...]  # (role, content), roles as in the chat template

    def to_json(self) -> str:
        messages = [{"role": role, "content": content} for role, content in self.messages]
        return json.dumps({"source": self.source, "messages": messages}, ensure_ascii=False)

    @staticmethod
    def from_json(line: str) -> Conversation:
        row = json.loads(line)
        return Conversation(row["source"], tuple((m["role"], m["content"]) for m in row["messages"]))


_UNKNOWN_REPLY_RE = re.compile(r"(?:I don't know the word |Sorry, )([a-z]+)(?:\.| is not)")


def unknown_words(conversations: list[Conversation]) -> list[str]:
    """The rare words that single-turn unknown_word conversations ask about, in order, read
    from their replies (the questions come in many phrasings): words never taught."""
    words = []
    for c in conversations:
        if c.source == "unknown_word" and len(c.messages) == 2 and (m := _UNKNOWN_REPLY_RE.match(c.messages[1][1])):
            words.append(m.group(1))
    return words


def split_of(key: str) -> Split:
    return Split.HELDOUT if zlib.crc32(key.encode()) % 100 < HELDOUT_PERCENT else Split.TRAIN


def first_senses(senses: list[Sense]) -> dict[str, Sense]:
    """One sense per lemma: the first sense of the POS with most SemCor-tagged senses."""
    best: dict[str, Sense] = {}
    for sense in senses:  # POS order noun, verb, adj, adv breaks ties
        current = best.get(sense.lemma)
        if current is None or sense.num_tagged_senses > current.num_tagged_senses:
            best[sense.lemma] = sense
    return best


def choose_words(senses: list[Sense], frequent: list[str], rng: random.Random) -> tuple[list[Sense], list[Sense]]:
    """(known, unknown): the frequent words WordNet defines, in frequency order; and a seeded
    sample of NUM_UNKNOWN_WORDS others (unfamiliar_words): NUM_LESS_COMMON_UNKNOWN less common
    ones (fewer where the frequency list is too short for the band), the rest rare ones."""
    best = first_senses(senses)
    top = dict.fromkeys(frequent[:NUM_FREQUENT_WORDS])
    known = [best[w] for w in top if w in best and w not in FUNCTION_WORDS]
    less_common, rare = unfamiliar_words(best, frequent)
    num_less_common = min(NUM_LESS_COMMON_UNKNOWN, len(less_common))
    picked = rng.sample(less_common, num_less_common)
    picked += rng.sample(rare, min(NUM_UNKNOWN_WORDS - num_less_common, len(rare)))
    return known, [best[w] for w in picked]


def unfamiliar_probes(best: dict[str, Sense], frequent: list[str], per_band: int, seed: int) -> dict[str, list[str]]:
    """A seeded sample of per_band held-out words (never trained) of each unfamiliar band, to
    ask a model about: {"less_common": [...], "rare": [...]}."""
    rng = random.Random(seed)
    bands = zip(("less_common", "rare"), unfamiliar_words(best, frequent), strict=True)
    probes = {}
    for name, words in bands:
        heldout = [w for w in words if split_of(w) is Split.HELDOUT]
        probes[name] = rng.sample(heldout, min(per_band, len(heldout)))
    return probes


def unfamiliar_words(best: dict[str, Sense], frequent: list[str]) -> tuple[list[str], list[str]]:
    """(less common, rare) lemmas WordNet defines, sorted: those ranked UNFAMILIAR_FROM_RANK to
    RARE_FROM_RANK in the frequency list, and those not among its first RARE_FROM_RANK words."""
    band = {w for w in frequent[UNFAMILIAR_FROM_RANK:RARE_FROM_RANK] if w not in FUNCTION_WORDS}
    common = set(frequent[:RARE_FROM_RANK])
    return sorted(w for w in best if w in band), sorted(w for w in best if w not in common)


def build_conversations(
    senses: list[Sense],
    fortunes: list[str],
    frequent: list[str],
    seed: int,
    example_words: tuple[str, ...] = smalltalk.EXAMPLE_WORDS,
) -> dict[Split, list[Conversation]]:
    """Every item is first built single-turn with its split key (known words have none: all
    are trained); some are then chained into multi-turn chats within the same split, and some
    get a system prompt. Replies that offer an example word offer one of example_words, each
    of which must be a known word."""
    rng = random.Random(seed)
    known, unknown = choose_words(senses, frequent, rng)
    taught = {s.lemma for s in known}
    if missing := [w for w in example_words if w not in taught]:
        raise ValueError(f"example words the models are not taught: {missing}")
    train_only: list[Conversation] = []
    for sense in known:
        train_only += _word_conversations(sense, rng)
    keyed: list[tuple[str, Conversation]] = []  # (split key, conversation)
    for sense in unknown:
        question = _definition_question(sense.lemma, sense.pos, rng)
        reply = rng.choice(smalltalk.UNKNOWN_WORD).format(unknown=sense.lemma, word=rng.choice(example_words))
        keyed.append((sense.lemma, _single("unknown_word", question, reply)))
    for fortune in sorted(fortunes, key=lambda f: zlib.crc32(f.encode()))[:NUM_FORTUNES]:
        keyed.append((fortune, _single("fortune", _vary(rng.choice(_FORTUNE_PROMPTS), rng), fortune)))
    keyed.extend(_smalltalk(example_words, rng))
    greet_rng = random.Random(seed * 31 + 7)
    train_only += _greeted_copies(train_only, greet_rng)
    keyed += [(key, copy) for key, conversation in keyed for copy in _greeted_copies([conversation], greet_rng)]
    splits: dict[Split, list[Conversation]] = {Split.TRAIN: list(train_only), Split.HELDOUT: []}
    for key, conversation in keyed:
        splits[split_of(key)].append(conversation)
    return {split: _chain_and_prompt(items, rng) for split, items in splits.items()}


def _word_conversations(sense: Sense, rng: random.Random) -> list[Conversation]:
    """Definitions asked NUM_DEFINITION_QUESTIONS ways (the canonical "What does X mean?"
    first); sometimes an example sentence or a synonym question too."""
    answer = definition_answer(sense)
    conversations = [_single("definition", _vary(f"What does {sense.lemma} mean?", rng), answer)]
    for _ in range(NUM_DEFINITION_QUESTIONS - 1):
        conversations.append(_single("definition", _definition_question(sense.lemma, sense.pos, rng), answer))
    if sense.examples and rng.random() < 0.15:
        question = _vary(f"Use {sense.lemma} in a sentence.", rng)
        conversations.append(_single("example", question, _example_answer(sense)))
    one_word_synonyms = [w for w in sense.synonyms if " " not in w]
    if one_word_synonyms and rng.random() < 0.1:
        template = rng.choices(_SYNONYM_QUESTIONS, weights=_SYNONYM_WEIGHTS)[0]
        question = _vary(template.format(w=sense.lemma), rng)
        conversations.append(_single("synonym", question, _synonym_answer(sense.lemma, one_word_synonyms)))
    return conversations


def definition_answer(sense: Sense) -> str:
    # "The noun dog means ..." rather than 'The word "dog" ...': after a space the word is the
    # same token as in the question, which a tiny model can copy far more easily.
    meaning = sense.definition
    if sense.pos is PartOfSpeech.VERB and not meaning.startswith("to "):
        meaning = f"to {meaning}"
    # No example sentence here (it is asked for apart): the definition is what a tiny model
    # must memorise, and every extra token competes for its capacity.
    return f"The {sense.pos.value} {sense.lemma} means {_sentence_end(meaning)}"


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


def _smalltalk(example_words: tuple[str, ...], rng: random.Random) -> list[tuple[str, Conversation]]:
    keyed = []
    for phrasings, replies in smalltalk.CANNED_GROUPS:
        for phrasing in phrasings:
            for _ in range(SMALLTALK_COPIES):
                reply = rng.choice(replies).format(word=rng.choice(example_words))
                # Canned turns are keyed by phrasing: a few phrasings stay unseen for held-out.
                keyed.append((phrasing, _single("smalltalk", _vary(phrasing, rng), reply)))
    for index in range(NUM_OFF_TOPIC):
        question = smalltalk.off_topic_question(rng)
        reply = rng.choice(smalltalk.REFUSALS).format(word=rng.choice(example_words))
        keyed.append((f"off_topic-{index}", _single("off_topic", _vary(question, rng), reply)))
    return keyed


def _greeted_copies(conversations: list[Conversation], rng: random.Random) -> list[Conversation]:
    """Copies of some single-turn conversations with a greeting before the question: about
    GREETED_PER_PHRASING of each canned question of smalltalk.ASKED_AFTER_GREETING,
    GREETED_SHARE of others (greetings and goodbyes are not greeted)."""
    greeted_phrasings = {
        p.lower().rstrip(".?!") for name in smalltalk.ASKED_AFTER_GREETING for p in smalltalk.CANNED[name][0]
    }
    copies = []
    for conversation in conversations:
        (_, question), (_, answer) = conversation.messages
        if conversation.source != "smalltalk":
            share = GREETED_SHARE
        elif question.lower().rstrip(".?!") in greeted_phrasings:
            share = GREETED_PER_PHRASING / SMALLTALK_COPIES
        else:
            share = 0.0
        if rng.random() < share:
            copies.append(_single(conversation.source, greeted(question, rng), answer))
    return copies


def greeted(question: str, rng: random.Random) -> str:
    """The question after a greeting, as a chat's first message often is: "Hi, who are you?"."""
    greeting = rng.choice(smalltalk.GREETING[0]).rstrip("!")
    if rng.random() < 0.5:
        question = question[:1].lower() + question[1:]
    return _vary(f"{greeting}{rng.choice(_GREETING_SEPARATORS)}{question}", rng)


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
