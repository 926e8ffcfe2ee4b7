"""The demo-model build pipeline's pure parts, on hand-written inputs: WordNet and fortune
parsing, answer formats, the held-out split, chat encoding with assistant-only labels, and
row packing. Needs neither the Debian packages nor training."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from scripts.demo_model.dataset import Conversation, Split, definition_answer, split_of
from scripts.demo_model.sources import PartOfSpeech, Sense, _normalise_fortune, _parse_data_line
from scripts.demo_model.tokenizer import IGNORE_INDEX, encode_conversation, quote_normalizer, save_tokenizer_files
from scripts.demo_model.train import MINI, learning_rate_at, pack_rows

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
DOG_LINE = (
    "02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 001 @ 02083346 n 0000 | a member "
    'of the genus Canis that has been domesticated by man; "the dog barked all night"'
)


def test_wordnet_data_line_parses_into_definition_example_and_synonyms():
    sense = _parse_data_line(DOG_LINE, "dog", PartOfSpeech.NOUN, 1)
    assert sense == Sense(
        "dog",
        PartOfSpeech.NOUN,
        "a member of the genus Canis that has been domesticated by man",
        ("the dog barked all night",),
        ("domestic dog", "Canis familiaris"),
        1,
    )


def test_wordnet_proper_noun_synsets_are_skipped():
    line = "09044862 15 n 01 Paris 0 001 @ 08524735 n 0000 | the capital of France"
    assert _parse_data_line(line, "paris", PartOfSpeech.NOUN, 0) is None


def test_definition_answer_names_part_of_speech_and_leaves_the_example_to_its_own_question():
    sense = _parse_data_line(DOG_LINE, "dog", PartOfSpeech.NOUN, 1)
    assert (
        definition_answer(sense) == "The noun dog means a member of the genus Canis that has been domesticated by man."
    )
    verb = Sense("run", PartOfSpeech.VERB, "move fast by using one's feet", (), (), 29)
    assert definition_answer(verb) == "The verb run means to move fast by using one's feet."


def test_fortune_keeps_attribution_on_its_own_line_and_drops_long_or_listed_ones():
    raw = "A dream will always triumph over reality.\n\t\t-- Stanislaw Lem"
    assert _normalise_fortune(raw) == "A dream will always triumph over reality.\n-- Stanislaw Lem"
    assert _normalise_fortune("(1) Avoid fried meats.\n(2) Keep going.") is None
    assert _normalise_fortune("word " * 60) is None


def test_heldout_split_is_a_stable_few_percent_of_keys():
    words = [f"word{i}" for i in range(5000)]
    heldout = [w for w in words if split_of(w) is Split.HELDOUT]
    assert 0.01 < len(heldout) / len(words) < 0.06
    assert [w for w in words if split_of(w) is Split.HELDOUT] == heldout


def test_encoding_equals_engine_rendered_template_and_labels_only_assistant_replies():
    tokenizer = Tokenizer.from_dir(MODELS_DIR / "demo-mini")
    raw = tokenizer._tok  # the same `tokenizers` object the build trains and saves
    conversation = Conversation(
        "multi_turn",
        (
            ("system", "Be concise."),
            ("user", "What does dog mean?"),
            ("assistant", "The noun dog means a domestic animal."),
            ("user", "Thanks!"),
            ("assistant", "You're welcome!"),
        ),
    )
    encoded = encode_conversation(raw, conversation)
    messages = [{"role": r, "content": c} for r, c in conversation.messages]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert list(encoded.input_ids) == tokenizer.encode(rendered)
    trained = tokenizer.decode([t for t in encoded.labels if t != IGNORE_INDEX], skip_special_tokens=False)
    assert trained == "The noun dog means a domestic animal.<|im_end|>You're welcome!<|im_end|>"


def test_pack_rows_fills_rows_with_whole_conversations_and_masks_padding():
    tokenizer = Tokenizer.from_dir(MODELS_DIR / "demo-mini")._tok
    conversations = [
        Conversation("smalltalk", (("user", f"Hi {i}"), ("assistant", "Hello! " * (i % 7 + 1)))) for i in range(40)
    ]
    encoded = [encode_conversation(tokenizer, c) for c in conversations]
    rows = pack_rows(encoded, 64, pad_id=2, rng=random.Random(0))
    assert all(len(ids) == 64 and len(labels) == 64 for ids, labels in rows)
    packed_tokens = sum(sum(1 for t in ids if t != 2) for ids, _ in rows)
    assert packed_tokens == sum(len(e.input_ids) for e in encoded)
    for ids, labels in rows:
        assert all(label == IGNORE_INDEX for token, label in zip(ids, labels, strict=True) if token == 2)


def test_learning_rate_warms_up_then_decays_to_a_tenth_and_depends_on_the_step_alone():
    import dataclasses

    assert learning_rate_at(0, MINI) < learning_rate_at(MINI.warmup_steps, MINI)
    assert learning_rate_at(MINI.warmup_steps, MINI) == MINI.learning_rate
    assert abs(learning_rate_at(MINI.decay_steps, MINI) - MINI.learning_rate / 10) < 1e-9
    longer = dataclasses.replace(MINI, max_steps=MINI.max_steps * 2)  # a run extended later
    assert [learning_rate_at(s, longer) for s in range(0, 3000, 7)] == [
        learning_rate_at(s, MINI) for s in range(0, 3000, 7)
    ]
    assert learning_rate_at(MINI.decay_steps + 500, longer) == learning_rate_at(MINI.decay_steps, MINI)


def _sense(lemma: str, pos: PartOfSpeech = PartOfSpeech.NOUN, tagged: int = 1) -> Sense:
    return Sense(lemma, pos, f"the meaning of {lemma}", (), (), tagged)


def test_known_words_are_the_frequent_ones_wordnet_defines_without_function_words():
    from scripts.demo_model.dataset import choose_words

    senses = [
        _sense("water"),
        _sense("are"),
        _sense("harbor"),
        _sense("zymurgy"),
        _sense("quokka"),
        _sense("water", PartOfSpeech.VERB, tagged=5),
    ]
    frequent = ["the", "are", "water", "harbor", "notinwordnet"]
    known, unknown = choose_words(senses, frequent, random.Random(0))
    assert [s.lemma for s in known] == ["water", "harbor"]  # frequency order; "are" is a function word
    assert known[0].pos is PartOfSpeech.VERB  # the part of speech with most tagged senses
    assert sorted(s.lemma for s in unknown) == ["quokka", "zymurgy"]  # never a frequent word


def test_unknown_words_can_come_from_the_less_common_band(monkeypatch):
    """Users ask about less common words ("yowl") more than rare ones: NUM_LESS_COMMON_UNKNOWN
    of the "I don't know" words come from the frequency band between the two; the probes
    asked after training are held-out words of each band, which no build trains on."""
    from scripts.demo_model import dataset

    monkeypatch.setattr(dataset, "NUM_FREQUENT_WORDS", 4)
    monkeypatch.setattr(dataset, "UNFAMILIAR_FROM_RANK", 6)
    monkeypatch.setattr(dataset, "RARE_FROM_RANK", 206)
    monkeypatch.setattr(dataset, "NUM_UNKNOWN_WORDS", 40)
    monkeypatch.setattr(dataset, "NUM_LESS_COMMON_UNKNOWN", 20)
    frequent = [f"common{i}" for i in range(6)] + [f"band{i}" for i in range(200)] + ["beyond"]
    senses = [_sense(w) for w in frequent] + [_sense(f"rare{i}") for i in range(100)]
    known, unknown = dataset.choose_words(senses, frequent, random.Random(0))
    assert [s.lemma for s in known] == [f"common{i}" for i in range(4)]
    lemmas = [s.lemma for s in unknown]
    assert sum(w.startswith("band") for w in lemmas) == 20
    assert sum(w.startswith("rare") or w == "beyond" for w in lemmas) == 20
    assert not {"common4", "common5"} & set(lemmas)  # between the known words and the band
    probes = dataset.unfamiliar_probes(dataset.first_senses(senses), frequent, 3, seed=0)
    assert all(w.startswith("band") for w in probes["less_common"]) and probes["less_common"]
    assert all(dataset.split_of(w) is Split.HELDOUT for band in probes.values() for w in band)
    splits = dataset.build_conversations(senses, ["A fortune."], frequent, seed=1, example_words=("common0",))
    trained = " ".join(content for c in splits[Split.TRAIN] for _, content in c.messages)
    assert not any(f" {w}." in trained or f" {w} " in trained for band in probes.values() for w in band)


@pytest.mark.parametrize(
    ("typed", "read"),
    [
        ('What does "friend" mean?', "What does friend mean?"),
        ("What does 'friend' mean?", "What does friend mean?"),
        ("What does \u201cfriend\u201d mean?", "What does friend mean?"),
        ("What is \u2018ice cream\u2019?", "What is ice cream?"),
        ('"friend"', "friend"),
        ('("word")', "(word)"),
        ('He said "go home" and left.', "He said go home and left."),
        ("don't, it\u2019s, I'm", "don't, it\u2019s, I'm"),  # apostrophes inside words stay
        ('a 5" screen', 'a 5" screen'),  # inches: no letter before the mark
        ("user\n'hi'", "user\nhi"),  # at a line start
    ],
)
def test_quote_normalizer_removes_quote_marks_around_words_only(typed, read):
    assert quote_normalizer().normalize_str(typed) == read


def test_served_tokenizer_reads_a_quoted_word_as_the_bare_word_and_training_keeps_quotes(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer

    committed = MODELS_DIR / "demo-mini" / "tokenizer.json"
    raw = RawTokenizer.from_file(str(committed))
    save_tokenizer_files(raw, tmp_path / "served", MINI.seq_len)
    save_tokenizer_files(raw, tmp_path / "training", MINI.seq_len, served=False)
    assert (tmp_path / "served" / "tokenizer.json").read_bytes() == committed.read_bytes()  # the build's file
    assert RawTokenizer.from_file(str(tmp_path / "training" / "tokenizer.json")).normalizer is None

    served = Tokenizer.from_dir(MODELS_DIR / "demo-mini")  # as the engine loads it
    asked = [
        served.encode_chat([{"role": "user", "content": q}])
        for q in ('What does "friend" mean?', "What does \u201cfriend\u201d mean?")
    ]
    assert asked == [served.encode_chat([{"role": "user", "content": "What does friend mean?"}])] * 2
    # Losses are measured on the training encoding: a reply's quote marks stay there.
    reply = 'Ask me what "water" means.'
    encoded = encode_conversation(served._tok, Conversation("smalltalk", (("user", "Hi"), ("assistant", reply))))
    trained = served.decode([t for t in encoded.labels if t != IGNORE_INDEX])
    assert trained == reply
    assert served._tok.normalizer is not None  # restored after encoding


def test_known_words_are_all_trained_and_unknown_ones_get_i_do_not_know():
    from scripts.demo_model.dataset import build_conversations

    senses = [_sense(f"word{c}") for c in "abcdefghij"] + [_sense(f"rare{c}") for c in "abcdefghijklmnopqrst"]
    frequent = [f"word{c}" for c in "abcdefghij"]
    splits = build_conversations(senses, ["A fortune for you today."], frequent, seed=1, example_words=("worda",))
    trained = [m for c in splits[Split.TRAIN] for m in c.messages]
    for lemma in frequent:
        answer = f"The noun {lemma} means the meaning of {lemma}."
        assert sum(content == answer for _, content in trained) >= 3  # asked three ways, never held out
        assert any(
            role == "user" and content.lower().startswith(f"what does {lemma} mean") for role, content in trained
        )
    replies = [
        content
        for c in splits[Split.TRAIN] + splits[Split.HELDOUT]
        for role, content in c.messages
        if role == "assistant" and "rare" in content
    ]
    # Each rare word is asked once, some again after a greeting; every answer says "I don't know".
    assert {w for r in replies for w in re.findall(r"\brare[a-t]\b", r)} == {f"rare{c}" for c in "abcdefghijklmnopqrst"}
    assert 20 <= len(replies) <= 26 and all("know" in r for r in replies)


def test_replies_offer_only_the_example_words_and_those_must_be_taught():
    from scripts.demo_model.dataset import build_conversations
    from scripts.demo_model.evaluate import example_word

    senses = [_sense(f"word{c}") for c in "abcdefghij"] + [_sense(f"rare{c}") for c in "abcdefghij"]
    frequent = [f"word{c}" for c in "abcdefghij"]
    splits = build_conversations(senses, ["A fortune."], frequent, seed=2, example_words=("wordb", "wordc"))
    replies = [content for c in splits[Split.TRAIN] for role, content in c.messages if role == "assistant"]
    offered = [word for reply in replies if (word := example_word(reply)) is not None]
    assert len(offered) > 100 and set(offered) == {"wordb", "wordc"}
    with pytest.raises(ValueError, match="not taught: \\['rarea'\\]"):
        build_conversations(senses, ["A fortune."], frequent, seed=2, example_words=("wordb", "rarea"))


def test_some_questions_are_also_asked_after_a_greeting_with_the_same_answer():
    from scripts.demo_model import smalltalk
    from scripts.demo_model.dataset import GREETED_PER_PHRASING, SMALLTALK_COPIES, _greeted_copies

    greetings = tuple(g.lower().rstrip("!") for g in smalltalk.GREETING[0])
    identity = [
        Conversation("smalltalk", (("user", p), ("assistant", "I am a demo.")))
        for p in smalltalk.IDENTITY[0]
        for _ in range(SMALLTALK_COPIES)
    ]
    hellos = [Conversation("smalltalk", (("user", p), ("assistant", "Hello!"))) for p in smalltalk.GREETING[0] * 6]
    words = [
        Conversation("definition", (("user", f"What does w{i} mean?"), ("assistant", f"w{i} means {i}.")))
        for i in range(2000)
    ]
    copies = _greeted_copies(identity + hellos + words, random.Random(3))
    by_source = {src: [c for c in copies if c.source == src] for src in ("smalltalk", "definition")}
    expected = GREETED_PER_PHRASING * len(smalltalk.IDENTITY[0])
    assert 0.6 * expected <= len(by_source["smalltalk"]) <= 1.4 * expected  # greetings themselves never greeted
    assert all(c.messages[1][1] == "I am a demo." for c in by_source["smalltalk"])
    assert 150 <= len(by_source["definition"]) <= 250  # GREETED_SHARE of 2000
    for c in copies:
        question = c.messages[0][1].lower()
        assert question.startswith(greetings), question
        word = re.search(r"w\d+", question)
        assert word is None or c.messages[1][1].startswith(word.group(0) + " means")


def test_reply_kind_names_each_trained_reply_and_greeted_probes_cover_every_kind():
    from scripts.demo_model import smalltalk
    from scripts.demo_model.evaluate import greeted_probes, reply_kind

    assert reply_kind(smalltalk.IDENTITY[1][1]) == "identity"
    assert reply_kind(smalltalk.HELP[1][0].format(word="river")) == "help"
    assert reply_kind(smalltalk.HOW_ARE_YOU[1][1]) == "how_are_you"
    assert reply_kind(smalltalk.THANKS[1][2]) == "thanks"
    assert reply_kind(smalltalk.UNKNOWN_WORD[0].format(unknown="zymurgy", word="dog")) == "unknown_word"
    assert reply_kind(smalltalk.REFUSALS[1].format(word="dog")) == "refusal"
    assert reply_kind("The noun dog means a member of the genus Canis.") == "definition"
    assert reply_kind("A witty saying proves nothing.\n-- Voltaire") == "fortune"
    assert reply_kind("The verb try to give a substitute for.") == "fortune"  # not a definition's form
    senses = [_sense(f"word{c}") for c in "abcdefghijklmnop"]
    probes = greeted_probes(senses)
    assert probes == greeted_probes(senses)  # seeded
    assert {p.expected for p in probes} == {
        "identity",
        "help",
        "how_are_you",
        "thanks",
        "definition",
        "refusal",
        "fortune",
    }
    greetings = tuple(g.lower().rstrip("!") for g in smalltalk.GREETING[0])
    assert all(p.message.lower().startswith(greetings) for p in probes)
    assert all((p.sense is not None) == (p.expected == "definition") for p in probes)


def test_an_answer_carries_the_sense_when_it_holds_half_its_content_words():
    from scripts.demo_model.evaluate import carries_sense, content_words

    sense = Sense("dog", PartOfSpeech.NOUN, "a member of the genus Canis that has been domesticated by man", (), (), 1)
    assert content_words(sense.definition, "dog") == {"member", "genus", "canis", "domesticated", "man"}
    assert carries_sense("The noun dog means a member of the genus Canis that was domesticated by man.", sense)
    assert carries_sense("The noun dog means a member of the genus Canis.", sense)  # 3 of 5
    assert not carries_sense("The noun dog means a small domesticated animal.", sense)  # 1 of 5
    assert not carries_sense("I don't know the word dog.", sense)


def _tiny_training(name: str, num_conversations: int, max_steps: int):
    """A tiny model spec, its config and encoded chat data (the demo-mini tokenizer): enough for
    a few training steps in a test."""
    from scripts.demo_model.train import ModelSpec, SpecialIds, llama_config

    tokenizer = Tokenizer.from_dir(MODELS_DIR / "demo-mini")._tok
    conversations = [
        Conversation("smalltalk", (("user", f"What does word{i} mean?"), ("assistant", "A thing. " * (i % 4 + 1))))
        for i in range(num_conversations)
    ]
    encoded = [encode_conversation(tokenizer, c) for c in conversations]
    spec = ModelSpec(
        name, 32, 1, 2, 1, 64, max_steps=max_steps, learning_rate=1e-2, decay_steps=max_steps, batch_size=2,
        seq_len=64, warmup_steps=1,
    )  # fmt: skip
    config = llama_config(spec, tokenizer.get_vocab_size(), SpecialIds(eos_token_id=2, pad_token_id=0))
    return spec, config, encoded


def test_training_is_reproducible_from_its_seed():
    """Same seed, same data: the same weights bit for bit (what `make demo-model` relies on)."""
    import torch

    from scripts.demo_model.train import train

    spec, config, encoded = _tiny_training("repro", 24, max_steps=4)

    def weights(seed: int) -> dict:
        model, _ = train(spec, config, (encoded[:20], encoded[20:]), seed)
        return {k: v.clone() for k, v in model.state_dict().items()}

    first, again, other = weights(7), weights(7), weights(8)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_a_run_resumed_from_its_checkpoint_ends_with_the_same_weights(tmp_path):
    """Stop after 3 steps, raise max_steps and resume: bit for bit the weights and log of an
    uninterrupted 6-step run. A checkpoint for other data is ignored, never loaded."""
    import dataclasses

    import torch

    from scripts.demo_model.train import Checkpointing, train

    spec, config, encoded = _tiny_training("resume", 30, max_steps=6)
    data = (encoded[:26], encoded[26:])
    straight, straight_result = train(spec, config, data, seed=3)
    checkpoint = Checkpointing(tmp_path / "checkpoint.pt", "data-v1")
    train(dataclasses.replace(spec, max_steps=3), config, data, seed=3, checkpoint=checkpoint)
    assert torch.load(checkpoint.path, weights_only=False)["step"] == 3
    resumed, resumed_result = train(spec, config, data, seed=3, checkpoint=checkpoint)
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in straight.state_dict().items())
    train_rows = [r for r in straight_result.log_rows if "train_loss" in r]
    assert train_rows == [r for r in resumed_result.log_rows if "train_loss" in r]
    other_data = Checkpointing(checkpoint.path, "data-v2")  # same file, other data: starts over
    assert other_data.restore(spec, resumed, torch.optim.AdamW(resumed.parameters()))[0] == 0


def test_training_loss_is_the_models_own_loss_over_labelled_positions():
    import torch

    from scripts.demo_model.train import SpecialIds, _loss, llama_config

    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(MINI, 4096, SpecialIds(eos_token_id=1, pad_token_id=0)))
    input_ids = torch.randint(0, 4096, (2, 48))
    labels = input_ids.clone()
    labels[0, :20] = IGNORE_INDEX
    labels[1, 30:] = IGNORE_INDEX
    expected = model(input_ids=input_ids, labels=labels).loss
    assert torch.allclose(_loss(model, input_ids, labels), expected, atol=1e-5)
