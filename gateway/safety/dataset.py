"""The labelled safety set (safety/*.jsonl): loading, and the examples a head is trained on.

Read by scripts/train_safety.py and scripts/eval_safety.py and by the tests; the gate
itself never reads it. See safety/README.md for the record format and provenance.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from gateway.safety.types import BENIGN, CATEGORIES

DATA_DIR = Path(__file__).resolve().parents[2] / "safety"
CLASSES: tuple[str, ...] = (BENIGN, *CATEGORIES)


@dataclass(frozen=True, slots=True)
class Record:
    id: str
    split: str  # "train" or "heldout"
    kind: str  # "prompt" (user turns) or "response" (assistant text)
    label: str  # "benign" or a category
    topic: str  # for benign records: medical, legal, security, ...; "multi_turn" for conversations
    turns: tuple[str, ...]
    source: str = ""  # "" for the first, hand-written JSON records; else what safety/build_data.py built it from

    @property
    def is_harmful(self) -> bool:
        return self.label != BENIGN

    @property
    def is_multi_turn(self) -> bool:
        return len(self.turns) > 1


def load_split(split: str, data_dir: Path = DATA_DIR) -> list[Record]:
    records = []
    with open(data_dir / f"{split}.jsonl", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            raw = json.loads(line)
            record = Record(
                id=raw["id"],
                split=raw["split"],
                kind=raw["kind"],
                label=raw["label"],
                topic=raw["topic"],
                turns=tuple(raw["turns"]),
                source=raw.get("source", ""),
            )
            if record.split != split or record.label not in CLASSES or not record.turns:
                raise ValueError(f"{split}.jsonl:{line_no}: bad record {record.id}")
            records.append(record)
    return records


@dataclass(frozen=True, slots=True)
class Example:
    turns: tuple[str, ...]  # user turns read together, newest last
    label: int  # index into CLASSES


def training_examples(
    records: list[Record], *, seed: int, num_prefixed: int = 2, benign_openings: bool = False
) -> list[Example]:
    """The records as examples, plus augmentations that teach the head about context.

    - single prompts also appear after 1-3 random benign single-turn prompts, keeping their
      label (a harmful ask stays harmful after small talk; a benign one stays benign);
    - every prefix of a benign conversation is benign (each of its requests was allowed);
    - with `benign_openings`, so is every prefix of a harmful conversation that stops before
      its last turn: the request is only complete there, and the same opening also starts a
      benign twin."""
    rng = random.Random(seed)
    pool = [r.turns[0] for r in records if not r.is_harmful and not r.is_multi_turn and r.kind == "prompt"]
    examples = []
    for r in records:
        label = CLASSES.index(r.label)
        examples.append(Example(r.turns, label))
        if r.kind == "prompt" and not r.is_multi_turn:
            for _ in range(num_prefixed):
                prefix = rng.sample(pool, rng.randint(1, 3))
                examples.append(Example((*prefix, *r.turns), label))
        if r.is_multi_turn and (benign_openings or not r.is_harmful):
            examples.extend(Example(r.turns[:i], 0) for i in range(1, len(r.turns)))
    return examples
