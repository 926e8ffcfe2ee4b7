"""The labelled safety set: well-formed records, and no held-out record leaks into training."""

from __future__ import annotations

import hashlib
import re

from gateway.safety.dataset import CLASSES, load_split


def normalized(turns: tuple[str, ...]) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", "", " ".join(turns).lower()).split())


def test_record_ids_are_the_sha1_of_their_turns():
    for split in ("train", "heldout"):
        for r in load_split(split):
            assert r.id == hashlib.sha1("\n".join(r.turns).encode("utf-8")).hexdigest()[:12], r.turns


def test_no_held_out_text_is_in_the_train_split():
    train = {normalized(r.turns) for r in load_split("train")}
    leaked = [r.turns for r in load_split("heldout") if normalized(r.turns) in train]
    assert leaked == []


def test_every_class_has_held_out_prompts():
    labels = {r.label for r in load_split("heldout") if r.kind == "prompt"}
    assert labels == set(CLASSES)


def test_demo_answers_are_benign_answers_of_both_models():
    """What the demo models say, canned replies included (some of which the classifier was
    trained on, as users see them most): the set make eval-safety measures false blocks on."""
    answers = load_split("demo_answers")
    sources = {r.source for r in answers}
    assert {"demo_canned", "demo_sampled_demo-mini", "demo_sampled_demo-flagship"} <= sources
    assert len(answers) >= 200
    assert all(r.kind == "response" and r.label == "benign" for r in answers)
    assert all(r.id == hashlib.sha1(r.turns[0].encode("utf-8")).hexdigest()[:12] for r in answers)
