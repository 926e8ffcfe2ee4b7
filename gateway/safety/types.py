"""Value types of the safety gate: the verdict every layer returns and the layer names.

Plain data only; nothing here loads a model or touches the event loop.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

# Categories the classifier head is trained on (see safety/README.md). Operators' deny rules
# may name further categories of their own; the classifier never returns those.
CATEGORIES: tuple[str, ...] = ("weapons", "self_harm", "malware", "sexual_minors", "hate")
BENIGN = "benign"


class SafetyLayer(enum.StrEnum):
    """Which layer decided. A str Enum, so `verdict.layer == "rules"` reads naturally."""

    RULES = "rules"
    CLASSIFIER = "classifier"


class Stage(enum.StrEnum):
    PROMPT = "prompt"  # screening a conversation before the engine
    OUTPUT = "output"  # filtering a streamed answer
    MODERATION = "moderation"  # assessing a text for POST /v1/moderations


@dataclass(frozen=True, slots=True)
class Verdict:
    """The gate's decision. When blocked, `layer` and `category` say why; `score` is the
    classifier's probability for that category (None for rules)."""

    allowed: bool
    layer: SafetyLayer | None = None
    category: str | None = None
    score: float | None = None

    @classmethod
    def allow(cls) -> Verdict:
        return _ALLOW

    @classmethod
    def block(cls, layer: SafetyLayer, category: str, score: float | None = None) -> Verdict:
        return cls(allowed=False, layer=layer, category=category, score=score)


_ALLOW = Verdict(allowed=True)


@dataclass(frozen=True, slots=True)
class Assessment:
    """Every layer's finding on one text read as a prompt (SafetyGate.assess): `verdict` is what
    screening it would decide; `rule_categories` every category a deny rule matched, in
    declaration order; `scores` the classifier's probability per category (None without a
    classifier); `flagged` the categories that block it: the rules' matches, then the classifier's
    categories at or over their thresholds. `verdict` blocks exactly when `flagged` is not empty."""

    verdict: Verdict
    rule_categories: tuple[str, ...]
    scores: Mapping[str, float] | None
    flagged: tuple[str, ...]
