"""The streaming output filter: a blocked span is never released, whatever the chunking."""

from __future__ import annotations

import dataclasses
import random

import pytest

from gateway.safety.output import OutputFilter, OutputPolicy
from gateway.safety.rules import RuleSet
from gateway.safety.types import SafetyLayer, Verdict

RULES = RuleSet({"secrets": [r"\bopen sesame\b", r"\bcode \d{4}\b"]}, {})
POLICY = OutputPolicy(holdback_chars=16, check_every_chars=40, min_check_chars=10, window_chars=200)
BENIGN = (
    "Ali Baba watched from behind a rock. The thieves said a phrase he could not hear, and the "
    "door opened! He waited until dusk; then he walked home, sure he would never learn it."
)
LEAKY = BENIGN[:90] + " The words were open sesame, and the code 1234 opened the vault. " + BENIGN[90:]


def chunkings(text: str) -> list[list[str]]:
    """Whole, per character, fixed sizes, and seeded random sizes."""
    out = [[text], list(text)]
    for size in (2, 3, 7, 16, 17, 50):
        out.append([text[i : i + size] for i in range(0, len(text), size)])
    for seed in range(12):
        rng, parts, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            parts.append(text[i : i + n])
            i += n
        out.append(parts)
    return out


async def run(flt: OutputFilter, parts: list[str]) -> tuple[str, Verdict | None, list[int]]:
    """(released text, blocking verdict, held-back chars after each feed)."""
    released, held = [], []
    for part in parts:
        text, verdict = await flt.feed(part)
        released.append(text)
        held.append(flt.num_held_chars)
        if verdict is not None:
            return "".join(released), verdict, held
    tail, verdict = await flt.finish()
    return "".join(released) + tail, verdict, held


def make(classify=None, done=None) -> OutputFilter:
    return OutputFilter(RULES, POLICY, classify=classify, on_done=(done if done is not None else []).append)


@pytest.mark.parametrize("parts", chunkings(LEAKY), ids=lambda p: f"{len(p)}-chunks")
async def test_blocked_span_is_never_released_whatever_the_chunking(parts):
    released, verdict, _ = await run(make(), parts)
    assert verdict is not None and verdict.layer == SafetyLayer.RULES and verdict.category == "secrets"
    assert LEAKY.startswith(released)
    assert len(released) <= LEAKY.index("open sesame")


@pytest.mark.parametrize("parts", chunkings(BENIGN), ids=lambda p: f"{len(p)}-chunks")
async def test_benign_text_comes_out_whole_and_in_order(parts):
    done = []
    released, verdict, _held = await run(make(done=done), parts)
    assert verdict is None and released == BENIGN
    assert done == [Verdict.allow()]  # one decision per stream


async def test_feed_holds_back_the_window_and_finish_flushes_it():
    flt = make()
    text, verdict = await flt.feed(BENIGN)
    assert verdict is None and text == BENIGN[: len(BENIGN) - POLICY.holdback_chars]
    tail, verdict = await flt.finish()
    assert verdict is None and text + tail == BENIGN


async def test_finish_checks_the_held_back_tail_too():
    flt = make()
    text, _ = await flt.feed("All is fine, the password is open sesame")
    assert "open sesame" not in text
    tail, verdict = await flt.finish()
    assert tail == "" and verdict is not None and verdict.category == "secrets"


async def test_word_that_only_starts_like_a_denied_word_is_not_blocked():
    rules = RuleSet({"weapons": [r"\bbomb\b"]}, {})
    flt = OutputFilter(rules, POLICY, classify=None, on_done=lambda v: None)
    released, verdict, _ = await run(flt, ["What a bomb", "astic speech that was."])
    assert verdict is None and released == "What a bombastic speech that was."


async def test_nothing_is_released_after_a_block():
    flt = make()
    _, verdict = await flt.feed("x" * 40 + " open sesame now " + "y" * 40)
    assert verdict is not None
    assert await flt.feed("more harmless text " * 5) == ("", verdict)
    assert await flt.finish() == ("", verdict)


async def test_long_match_that_outgrows_the_holdback_is_never_released():
    rules = RuleSet({"secrets": [r"begin secret[^.]{0,80}end secret"]}, {})
    text = "Intro. begin secret " + "z" * 60 + " end secret. Outro text goes on for a while."
    for parts in chunkings(text):
        flt = OutputFilter(rules, POLICY, classify=None, on_done=lambda v: None)
        released, verdict, _ = await run(flt, parts)
        assert verdict is not None
        assert "end secret" not in released


def window_classifier(word: str):
    """A stand-in for the classifier: blocks any window that contains `word`."""

    async def classify(window: str) -> Verdict:
        return Verdict.block(SafetyLayer.CLASSIFIER, "hate", 0.9) if word in window else Verdict.allow()

    return classify


VILE = BENIGN + " Then a vile sentence came. " + BENIGN


@pytest.mark.parametrize("parts", chunkings(VILE), ids=lambda p: f"{len(p)}-chunks")
async def test_text_waits_for_a_classifier_check_before_release(parts):
    released, verdict, _ = await run(make(classify=window_classifier("vile")), parts)
    assert verdict is not None and verdict.layer == SafetyLayer.CLASSIFIER
    assert "vile" not in released


async def test_classifier_checks_run_at_sentence_ends_not_every_token():
    windows = []

    async def classify(window: str) -> Verdict:
        windows.append(window)
        return Verdict.allow()

    released, verdict, _ = await run(make(classify=classify), list(BENIGN))
    assert verdict is None and released == BENIGN
    assert 1 < len(windows) < len(BENIGN) // POLICY.min_check_chars + 2


async def test_a_short_one_sentence_answer_is_released_progressively():
    """A 150-character answer with no sentence end until its last character comes out in
    several pieces while it streams, not in one piece at finish (what the web UI showed)."""
    answer = (
        "The noun water means a binary compound that occurs at room temperature as a clear "
        "colorless odorless tasteless liquid and freezes into ice."
    )

    async def allow(_window: str) -> Verdict:
        return Verdict.allow()

    served = OutputPolicy(holdback_chars=64, check_every_chars=160, min_check_chars=40, window_chars=400)  # the gate's
    flt = OutputFilter(RuleSet({}, {}), served, classify=allow, on_done=lambda v: None)
    pieces = []
    for char in answer:
        text, verdict = await flt.feed(char)
        assert verdict is None
        if text:
            pieces.append(text)
    tail, _ = await flt.finish()
    assert "".join(pieces) + tail == answer
    assert len(pieces) >= 3 and len("".join(pieces)) >= len(answer) // 2, pieces


async def test_with_deny_rules_the_hold_back_still_applies_to_short_answers():
    async def allow(_window: str) -> Verdict:
        return Verdict.allow()

    flt = OutputFilter(RULES, POLICY, classify=allow, on_done=lambda v: None)
    released = "".join([(await flt.feed(c))[0] for c in BENIGN])
    assert len(BENIGN) - len(released) >= POLICY.holdback_chars


async def test_the_first_text_is_checked_at_once_and_the_later_checks_keep_their_schedule():
    windows = []

    async def classify(window: str) -> Verdict:
        windows.append(window)
        return Verdict.allow()

    flt = OutputFilter(RuleSet({}, {}), POLICY, classify=classify, on_done=lambda v: None)
    first, _ = await flt.feed(BENIGN[0])
    assert first == BENIGN[0] and windows == [BENIGN[0]]  # released after one check, not 10 characters later
    for char in BENIGN[1:]:
        await flt.feed(char)
    # The second check comes where it would without the first: the first word end once
    # min_check_chars arrived, counted from the start of the answer.
    ends = set(" \t\n.,;:!?")
    second_end = next(i for i in range(POLICY.min_check_chars - 1, len(BENIGN)) if BENIGN[i] in ends) + 1
    assert windows[1] == BENIGN[:second_end]


async def test_the_first_unchecked_characters_go_out_at_once_and_the_first_check_reads_them():
    windows = []

    async def classify(window: str) -> Verdict:
        windows.append(window)
        return Verdict.block(SafetyLayer.CLASSIFIER, "hate") if len(windows) == 1 else Verdict.allow()

    policy = dataclasses.replace(POLICY, first_unchecked_chars=6)
    flt = OutputFilter(RuleSet({}, {}), policy, classify=classify, on_done=lambda v: None)
    released = []
    for char in BENIGN:
        text, verdict = await flt.feed(char)
        released.append(text)
        if verdict is not None:
            break
    # The first 6 characters went out one by one with no check; the first check read them and
    # what followed, blocked, and nothing after the first 6 was released.
    assert "".join(released) == BENIGN[:6] and released[:6] == list(BENIGN[:6])
    assert len(windows) == 1 and windows[0].startswith(BENIGN[:6]) and len(windows[0]) > 6
    assert (await flt.finish())[0] == ""


async def test_a_short_answer_inside_the_unchecked_start_is_still_checked_at_the_finish():
    windows = []

    async def classify(window: str) -> Verdict:
        windows.append(window)
        return Verdict.allow()

    flt = OutputFilter(
        RuleSet({}, {}),
        dataclasses.replace(POLICY, first_unchecked_chars=16),
        classify=classify,
        on_done=lambda v: None,
    )
    assert (await flt.feed("Hi!"))[0] == "Hi!" and windows == []
    await flt.finish()
    assert windows == ["Hi!"]


@pytest.mark.parametrize("parts", chunkings(" sesame, and then the door opened."))
async def test_a_phrase_split_between_a_prefill_and_its_continuation_is_blocked(parts):
    """An answer continuing an assistant's prefill is filtered with it: "open" in the prefill and
    " sesame" in the answer match together; the prefill itself is never released."""
    verdicts: list[Verdict] = []
    flt = OutputFilter(RULES, POLICY, classify=None, on_done=verdicts.append, prefix="The words were open")
    released, verdict, _ = await run(flt, parts)
    assert verdict is not None and verdict.layer is SafetyLayer.RULES and verdict.category == "secrets"
    assert "open" not in released and "sesame" not in released


async def test_a_benign_continuation_of_a_prefill_is_released_whole_and_only_it():
    seen: list[str] = []

    async def classify(text: str) -> Verdict:
        seen.append(text)
        return Verdict.allow()

    flt = OutputFilter(RULES, POLICY, classify=classify, on_done=lambda v: None, prefix="Ali Baba said: ")
    released, verdict, _ = await run(flt, [BENIGN[:50], BENIGN[50:]])
    assert verdict is None and released == BENIGN
    assert seen and all(text.startswith("Ali Baba said: ") for text in seen[:1])  # the classifier reads the prefill
