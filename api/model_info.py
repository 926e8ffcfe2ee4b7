"""What /v1/models says about a model beyond OpenAI's fields, for the web UI's empty chat:
its context length (`max_model_len`, as vLLM names it) and, from the model card (README.md
in its folder), the one-line description (the card's first paragraph, in bold) and the
example prompts of its "Try:" line. Cards are read once per process.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

_BOLD_LEAD = re.compile(r"^\*\*(.+?)\*\*")
_QUOTED = re.compile(r'"([^"]+)"')
_MAX_DESCRIPTION_CHARS = 300
_MAX_EXAMPLES = 3


@dataclass(frozen=True, slots=True)
class CardSummary:
    description: str | None
    example_prompts: tuple[str, ...]


@functools.lru_cache(maxsize=64)
def card_summary(model_dir: str) -> CardSummary:
    """The card's bold first paragraph and "Try:" prompts; empty when there is no card."""
    try:
        text = (Path(model_dir) / "README.md").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return CardSummary(None, ())
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip() and not p.lstrip().startswith(("#", "---"))]
    description = None
    if paragraphs and (match := _BOLD_LEAD.match(paragraphs[0])):
        description = match.group(1).strip()[:_MAX_DESCRIPTION_CHARS]
    examples: tuple[str, ...] = ()
    for line in text.splitlines():
        if line.startswith("Try: "):
            examples = tuple(_QUOTED.findall(line))[:_MAX_EXAMPLES]
            break
    return CardSummary(description, examples)


@functools.lru_cache(maxsize=64)
def created_at(model_dir: str) -> int:
    """OpenAI's `created` for a local model: when its config.json was written (0 when unknown)."""
    try:
        return int((Path(model_dir) / "config.json").stat().st_mtime)
    except OSError:
        return 0


def model_extras(model_dir: str, max_model_len: int) -> dict:
    summary = card_summary(model_dir) if model_dir else CardSummary(None, ())
    extras: dict = {"max_model_len": max_model_len}
    if summary.description:
        extras["description"] = summary.description
    if summary.example_prompts:
        extras["example_prompts"] = list(summary.example_prompts)
    return extras
