"""Reads the raw text the demo data is made of: WordNet 3.0 (Debian `wordnet-base`), the
fortune cookie files (Debian `fortunes`, `fortunes-min`) and the English word frequency list of
`wordfreq` (PyPI, pinned in requirements-dev.txt). Pure parsing with no sampling and no
randomness: which records become conversations is decided in dataset.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

WORDNET_DIR = Path("/usr/share/wordnet")
FORTUNES_DIR = Path("/usr/share/games/fortunes")
# What `make demo-model` must apt-get install before building.
APT_PACKAGES = ("wordnet-base", "fortunes", "fortunes-min")
# Tame, mostly one-liner cookie files; the rest (politics, ethnic, men-women...) are left out
# on purpose, a demo should not greet newcomers with dated jokes.
FORTUNE_FILES = (
    "fortunes",
    "wisdom",
    "platitudes",
    "science",
    "literature",
    "humorists",
    "work",
    "food",
    "pets",
    "kids",
    "education",
    "art",
    "love",
    "tao",
    "computers",
)
_LEMMA_RE = re.compile(r"^[a-z]{3,16}$")
_ADJ_MARKER_RE = re.compile(r"\((a|p|ip)\)$")
_QUOTED_RE = re.compile(r'"([^"]+)"')
_MAX_FORTUNE_CHARS = 200
_LONG_DEFINITION_CHARS = 100
_MAX_DEFINITION_CHARS = 160
_MAX_FORTUNE_LINES = 4


class PartOfSpeech(Enum):
    NOUN = "noun"
    VERB = "verb"
    ADJECTIVE = "adjective"
    ADVERB = "adverb"


_POS_FILE_SUFFIX = {
    PartOfSpeech.NOUN: "noun",
    PartOfSpeech.VERB: "verb",
    PartOfSpeech.ADJECTIVE: "adj",
    PartOfSpeech.ADVERB: "adv",
}


@dataclass(frozen=True, slots=True)
class Sense:
    """The most frequent WordNet sense of one lemma in one part of speech."""

    lemma: str
    pos: PartOfSpeech
    definition: str
    examples: tuple[str, ...]
    synonyms: tuple[str, ...]
    # SemCor-tagged senses of the lemma in this part of speech: a rough commonness score.
    num_tagged_senses: int


def read_senses(wordnet_dir: Path = WORDNET_DIR) -> list[Sense]:
    """First (most frequent) sense of every plain lowercase single-word lemma, all four POS."""
    if not (wordnet_dir / "index.noun").is_file():
        raise FileNotFoundError(f"WordNet not found in {wordnet_dir}: apt-get install wordnet-base")
    senses: list[Sense] = []
    for pos in PartOfSpeech:
        suffix = _POS_FILE_SUFFIX[pos]
        data_bytes = (wordnet_dir / f"data.{suffix}").read_bytes()
        for lemma, offset, num_tagged in _read_index(wordnet_dir / f"index.{suffix}"):
            end = data_bytes.index(b"\n", offset)
            sense = _parse_data_line(data_bytes[offset:end].decode("utf-8"), lemma, pos, num_tagged)
            if sense is not None:
                senses.append(sense)
    return senses


def read_frequent_words(num_words: int) -> list[str]:
    """The num_words most frequent English words (wordfreq's blended corpus), most frequent
    first; only plain lowercase words that WordNet lemmas can match."""
    import wordfreq  # build-time only: the server never imports it

    return [w for w in wordfreq.top_n_list("en", num_words) if _LEMMA_RE.match(w)]


def _read_index(index_path: Path) -> list[tuple[str, int, int]]:
    """(lemma, byte offset of its first synset in the data file, tagged sense count)."""
    rows = []
    for line in index_path.read_text(encoding="utf-8").splitlines():
        if line.startswith(" "):  # licence header
            continue
        fields = line.split()
        lemma = fields[0]
        if not _LEMMA_RE.match(lemma):
            continue
        num_pointers = int(fields[3])
        num_tagged = int(fields[5 + num_pointers])
        # Synset offsets follow the counts, ordered by decreasing frequency.
        first_offset = int(fields[6 + num_pointers])
        rows.append((lemma, first_offset, num_tagged))
    return rows


def _parse_data_line(line: str, lemma: str, pos: PartOfSpeech, num_tagged: int) -> Sense | None:
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    num_words = int(fields[3], 16)
    words = [_ADJ_MARKER_RE.sub("", w).replace("_", " ") for w in fields[4 : 4 + 2 * num_words : 2]]
    if lemma not in words:  # only capitalised forms: a proper noun or a taxon, not a plain word
        return None
    synonyms = tuple(w for w in words if w.lower() != lemma and w.isascii())
    definition, examples = _split_gloss(gloss)
    if len(definition) > _LONG_DEFINITION_CHARS:  # keep the main clause of rambling glosses
        definition = definition.split("; ")[0]
    if not definition or len(definition) > _MAX_DEFINITION_CHARS:
        return None
    return Sense(lemma, pos, definition, examples, synonyms, num_tagged)


def _split_gloss(gloss: str) -> tuple[str, tuple[str, ...]]:
    """WordNet glosses are 'definition; "example"; "example"' with quotes around examples."""
    gloss = " ".join(gloss.split())
    quote_at = gloss.find('"')
    definition = (gloss if quote_at < 0 else gloss[:quote_at]).strip().rstrip(";:,").strip()
    examples = tuple(e.strip() for e in _QUOTED_RE.findall(gloss[max(quote_at, 0) :]) if 3 <= len(e.strip()) <= 150)
    return definition, examples if quote_at >= 0 else ()


def read_fortunes(fortunes_dir: Path = FORTUNES_DIR) -> list[str]:
    """Short fortunes from FORTUNE_FILES, whitespace-normalised, attribution on its own line."""
    if not (fortunes_dir / "fortunes").is_file():
        raise FileNotFoundError(f"fortunes not found in {fortunes_dir}: apt-get install fortunes")
    fortunes = []
    for name in FORTUNE_FILES:
        text = (fortunes_dir / name).read_text(encoding="utf-8", errors="replace")
        for raw in text.split("\n%\n"):
            fortune = _normalise_fortune(raw)
            if fortune is not None:
                fortunes.append(fortune)
    return fortunes


def _normalise_fortune(raw: str) -> str | None:
    lines = [line for line in raw.strip("%\n").splitlines() if line.strip()]
    if not lines or len(lines) > _MAX_FORTUNE_LINES:
        return None
    body_lines = [line for line in lines if not line.strip().startswith("--")]
    attribution = [line.strip() for line in lines if line.strip().startswith("--")]
    body = " ".join(" ".join(body_lines).split())
    if len(attribution) > 1 or not 20 <= len(body) <= _MAX_FORTUNE_CHARS:
        return None
    text = body if not attribution else f"{body}\n{' '.join(attribution[0].split())}"
    # Overstrike (backspace) art, non-ASCII and Q/A or numbered-list layouts read badly in chat.
    if not text.isascii() or "\b" in text or re.match(r"^(\(?\d|Q:|A:)", body):
        return None
    return text
