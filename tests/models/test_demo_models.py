"""The committed demo models: complete Hugging Face folders within the size limits, the
project's chat template, the first sense of the words they claim to know, "I don't know" for
others, and readable answers to held-out questions. Runs the real weights with transformers on
CPU."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from scripts.demo_model.dataset import unknown_words

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
MODEL_NAMES = ("demo-mini", "demo-flagship")
PROJECT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "loss_curve.png",
)
PARAMETER_RANGES = {"demo-mini": (1e6, 2e6), "demo-flagship": (2e6, 5e6)}
# Of models/known_words.jsonl (40 taught words, not the card's sample), the share a model must
# answer with the first sense; the cards report the share on 400 words (flagship >= 95%).
MIN_KNOWN_WORDS_RIGHT = {"demo-mini": 0.8, "demo-flagship": 0.9}
# Of the greeted first messages ("Hi, who are you?", evaluate.greeted_probes over the 40 words
# above), the share a model must answer with the kind of reply asked for; the cards report it.
MIN_GREETED_RIGHT = {"demo-mini": 0.8, "demo-flagship": 0.8}
MAX_TOTAL_WEIGHT_BYTES = 60 * 1024 * 1024
_WORDLIKE = re.compile(r"^[\"'(]*[A-Za-z][A-Za-z'-]*[.,;:!?)\"']*$")
# Glue words make up 15-50% of real English sentences (and of every held-out answer) but under
# 10% of random token soup, even soup made of whole-word tokens.
_FUNCTION_WORDS = frozenset(
    "the a an of to in on for with by and or but not is are was be as at that this it from which "
    "who what when used having has have one its their his her any some".split()
)


def _parameter_count_and_dtypes(name: str) -> tuple[int, set[str]]:
    count, dtypes = 0, set()
    with safe_open(MODELS_DIR / name / "model.safetensors", framework="pt") as weights:
        for key in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
            tensor = weights.get_slice(key)
            shape = tensor.get_shape()
            count += math.prod(shape)
            dtypes.add(tensor.get_dtype())
    return count, dtypes


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_folder_has_hf_files_16bit_weights_and_parameter_count_in_range(name):
    for filename in REQUIRED_FILES:
        assert (MODELS_DIR / name / filename).is_file(), filename
    count, dtypes = _parameter_count_and_dtypes(name)
    low, high = PARAMETER_RANGES[name]
    assert low <= count <= high
    assert dtypes <= {"BF16", "F16"}
    config = json.loads((MODELS_DIR / name / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_both_models_weigh_under_60_mb_together():
    total = sum((MODELS_DIR / name / "model.safetensors").stat().st_size for name in MODEL_NAMES)
    assert total < MAX_TOTAL_WEIGHT_BYTES


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tokenizer_config_has_project_chat_template_and_im_end_is_eos(name):
    tokenizer_config = json.loads((MODELS_DIR / name / "tokenizer_config.json").read_text())
    generation_config = json.loads((MODELS_DIR / name / "generation_config.json").read_text())
    vocab = json.loads((MODELS_DIR / name / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in vocab}
    assert tokenizer_config["chat_template"] == PROJECT_CHAT_TEMPLATE
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["pad_token"] in ids
    assert generation_config["eos_token_id"] == [ids["<|im_end|>"]]
    assert "<|im_start|>" in ids


def test_models_share_one_tokenizer():
    mini, flagship = ((MODELS_DIR / name / "tokenizer.json").read_bytes() for name in MODEL_NAMES)
    assert mini == flagship


def test_heldout_sample_holds_only_words_kept_out_of_training(heldout_sample):
    from scripts.demo_model.dataset import Split, split_of

    questions = [c for c in heldout_sample if c.source == "unknown_word"]
    assert len(questions) >= 10
    known = {json.loads(line)["lemma"] for line in (MODELS_DIR / "known_words.jsonl").read_text().splitlines()}
    for conversation in questions:
        reply = conversation.messages[1][1]
        word = re.search(r"(?:the word|Sorry,) ([a-z]+)", reply).group(1)
        assert split_of(word) is Split.HELDOUT, word
        assert word not in known and word in conversation.messages[0][1]


@pytest.mark.parametrize("quoted", [False, True], ids=["bare", "in-quotes"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_answers_known_words_with_their_first_sense(name, quoted, loaded_models):
    """'What does X mean?', and the same with X in straight or curly quotes, as people type it
    (the served tokenizer removes the marks: 13-14 of 100 such questions were right before)."""
    from scripts.demo_model.evaluate import QUOTED_PROBES, known_word_score, read_known_words

    model, hf_tokenizer = loaded_models(name)
    words = read_known_words(MODELS_DIR / "known_words.jsonl")
    assert len(words) == 40
    questions = QUOTED_PROBES if quoted else ("What does {w} mean?",)
    score = known_word_score(model, hf_tokenizer, words, questions=questions)
    assert score.share >= MIN_KNOWN_WORDS_RIGHT[name], score.misses


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_answers_questions_that_open_with_a_greeting(name, loaded_models):
    from scripts.demo_model.evaluate import greeted_probes, greeted_score, read_known_words

    model, hf_tokenizer = loaded_models(name)
    score = greeted_score(model, hf_tokenizer, greeted_probes(read_known_words(MODELS_DIR / "known_words.jsonl")))
    assert score.num_probes >= 50
    assert score.share >= MIN_GREETED_RIGHT[name], score.misses


# What people type first to see whether a new chat works, and the kind of reply each must get
# (evaluate.reply_kind). "1+1" and "What is AI?" are not trained strings: off-topic templates
# ("{a}+{b}" with a, b from 2 to 99; "What is {acronym}?") are.
FIRST_MESSAGES = {
    "test": "help",
    "ok": "help",
    "Hello!": "greeting",
    "Who are you?": "identity",
    "1+1": "refusal",
    "What is AI?": "refusal",
    "Can you write code?": "refusal",
    "What does water mean?": "definition",
    "What does 'water' mean?": "definition",
    'What does "friend" mean?': "definition",
    "What does \u201cfriend\u201d mean?": "definition",
    "Why?": "help",
    "Bonjour": "refusal",
    "😀": "refusal",
}
# Other languages, emoji and mashed keys that training never showed (it shows others: the
# off-topic "{foreign}" and "{mash}" fillers): most should get the polite refusal too.
UNTRAINED_NOT_ENGLISH = (
    "Hola, ¿qué tal?",
    "Salut !",
    "Hallo",
    "Buongiorno",
    "Доброе утро",
    "谢谢",
    "おはよう",
    "🙂",
    "lkjhg",
    "??!",
)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_answers_what_people_type_first(name, loaded_models):
    from scripts.demo_model.evaluate import reply_kind, sample_reply

    model, hf_tokenizer = loaded_models(name)
    replies = {m: sample_reply(model, hf_tokenizer, [{"role": "user", "content": m}]) for m in FIRST_MESSAGES}
    wrong = {m: r for m, r in replies.items() if reply_kind(r) != FIRST_MESSAGES[m]}
    assert not wrong, wrong


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_declines_most_untrained_messages_in_other_languages(name, loaded_models):
    from scripts.demo_model.evaluate import reply_kind, sample_reply

    model, hf_tokenizer = loaded_models(name)
    replies = {m: sample_reply(model, hf_tokenizer, [{"role": "user", "content": m}]) for m in UNTRAINED_NOT_ENGLISH}
    wrong = {m: r for m, r in replies.items() if reply_kind(r) != "refusal"}
    assert len(wrong) <= 0.3 * len(UNTRAINED_NOT_ENGLISH), wrong


# Rare English words (none among the models' known words): asked "What does X mean?", a model
# should say it does not know them rather than make a definition up.
RARE_WORDS = (
    "zymurgy quokka perspicacious lugubrious sesquipedalian obsequious defenestration petrichor syzygy "
    "callipygian flibbertigibbet kerfuffle bumfuzzle cattywampus gobbledygook lollygag snollygoster "
    "widdershins xylograph quixotic"
).split()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_says_it_does_not_know_rare_words(name, loaded_models):
    """The trained "I don't know the word X" reply for at least 85% of 20 rare words (each
    build misses one or two, not always the same; the models often garble X when they repeat
    it: a 4,096-token vocabulary splits rare words into pieces a tiny model copies badly)."""
    from scripts.demo_model.evaluate import reply_kind, sample_reply

    model, hf_tokenizer = loaded_models(name)
    replies = {
        w: sample_reply(model, hf_tokenizer, [{"role": "user", "content": f"What does {w} mean?"}]) for w in RARE_WORDS
    }
    made_up = {w: r for w, r in replies.items() if reply_kind(r) != "unknown_word"}
    assert len(made_up) <= 0.15 * len(RARE_WORDS), made_up


def _known_words(hf_tokenizer) -> set[str]:
    """Whole-word tokens of the BPE vocabulary: the few thousand commonest training words."""
    return {t.lstrip("Ġ").lower() for t in hf_tokenizer.get_vocab() if t.lstrip("Ġ").isalpha()}


def _assert_readable(reply: str, known_words: set[str]) -> None:
    words = reply.split()
    assert len(words) >= 4, reply
    assert reply[-1] in '.!?"', reply
    wordlike = [w for w in words if _WORDLIKE.match(w)]
    assert len(wordlike) >= 0.85 * len(words), reply
    bare = [re.sub(r"[^A-Za-z]", "", w).lower() for w in wordlike]
    assert sum(w in known_words for w in bare) >= 0.5 * len(bare), reply
    assert sum(w in _FUNCTION_WORDS for w in bare) >= 0.15 * len(words), reply


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_answers_heldout_what_does_x_mean_with_words_and_punctuation(name, loaded_models, heldout_sample):
    from scripts.demo_model.evaluate import sample_reply

    model, hf_tokenizer = loaded_models(name)
    questions = [f"What does {word} mean?" for word in unknown_words(heldout_sample)][:2]
    assert questions
    for question in questions:
        reply = sample_reply(model, hf_tokenizer, [{"role": "user", "content": question}], max_new_tokens=64)
        _assert_readable(reply, _known_words(hf_tokenizer))


def test_heldout_perplexity_stays_that_of_language_not_of_noise(loaded_models, heldout_sample):
    """Held-out text (unknown words, fortunes, phrasings never trained on) stays predictable:
    memorising the known words must not wreck the rest. (The flagship, which memorises more,
    is not lower than the mini here; its edge is the known words, carded by both.)"""
    from scripts.demo_model.evaluate import heldout_loss, perplexity
    from scripts.demo_model.tokenizer import encode_conversation

    for name in MODEL_NAMES:
        model, hf_tokenizer = loaded_models(name)
        encoded = [encode_conversation(hf_tokenizer.backend_tokenizer, c) for c in heldout_sample]
        assert perplexity(heldout_loss(model, encoded)) < 30.0, name


def test_readability_check_rejects_random_token_soup():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS_DIR / "demo-mini")
    known_words, rng = _known_words(tokenizer), random.Random(0)
    num_rejected = 0
    for _ in range(100):
        soup = tokenizer.decode([rng.randrange(3, tokenizer.vocab_size) for _ in range(40)]) + "."
        try:
            _assert_readable(soup, known_words)
        except AssertionError:
            num_rejected += 1
    assert num_rejected >= 95
