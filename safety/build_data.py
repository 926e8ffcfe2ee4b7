"""Rebuild the added part of safety/{train,heldout}.jsonl from safety/sources/ and from Debian's
WordNet and fortunes packages. The first records of each file (no `source` field) were written
by hand directly in JSON and are kept as they are; records with a `source` are regenerated.

An added record is held out when its id (SHA-1 of its text) is 1 mod 4: about a quarter of
each group, and adding records never moves another one between the splits; the demo models'
canned replies are all trained on (they are measured through safety/demo_answers.jsonl).
Usage: .venv/bin/python -m safety.build_data   (needs: apt-get install wordnet-base fortunes)
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

# The Debian sources and fortune files the demo models were trained on.
from scripts.demo_model.sources import FORTUNE_FILES, FORTUNES_DIR, WORDNET_DIR

DATA_DIR = Path(__file__).resolve().parent
SOURCES_DIR = DATA_DIR / "sources"
NUM_FORTUNES = 160
NUM_DEFINITIONS = 200
# Dictionary words whose definitions mention violence, drugs or crime: the demo models answer
# "What does X mean?" for them, and a definition is not a harmful answer.
SENSITIVE_WORDS = (
    "bomb",
    "explosive",
    "dynamite",
    "grenade",
    "gun",
    "rifle",
    "pistol",
    "bullet",
    "knife",
    "dagger",
    "poison",
    "arsenic",
    "cyanide",
    "venom",
    "overdose",
    "suicide",
    "murder",
    "assassin",
    "homicide",
    "massacre",
    "genocide",
    "terrorism",
    "hostage",
    "kidnap",
    "strangle",
    "stab",
    "shoot",
    "kill",
    "slaughter",
    "torture",
    "weapon",
    "missile",
    "arson",
    "hacker",
    "virus",
    "malware",
    "spy",
    "racism",
    "bigot",
    "prejudice",
    "slavery",
    "noose",
    "gallows",
    "execution",
    "heroin",
    "cocaine",
    "morphine",
    "toxin",
    "nerve",
    "war",
    "battle",
    "soldier",
    "siege",
    "riot",
    "thief",
    "fraud",
)
NEAR_HELDOUT = 0.6
TOPIC_DEMO_TEXT = "demo_text"  # benign answers in the style of the bundled demo models
_FORTUNE_SKIP_RE = re.compile(r"\b(?:sex\w*|nigg\w*|fag\w*|rape\w*|jew\w*|negro\w*|whore\w*)\b", re.I)


def record_id(turns: list[str]) -> str:
    return hashlib.sha1("\n".join(turns).encode("utf-8")).hexdigest()[:12]


def read_sources() -> list[dict]:
    """Records from safety/sources/*.txt: `# kind label topic` headers, one record per line,
    turns of a conversation separated by ` || `."""
    records = []
    for path in sorted(SOURCES_DIR.glob("*.txt")):
        header = None
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            if line.startswith("# "):
                header = line[2:].split()
                continue
            if header is None or len(header) != 3:
                raise ValueError(f"{path.name}:{line_no}: record before a '# kind label topic' header")
            kind, label, topic = header
            turns = [t.strip() for t in line.split("||")]
            records.append({"kind": kind, "label": label, "topic": topic, "turns": turns, "source": path.stem})
    return records


def read_definitions() -> list[dict]:
    """Answers shaped like the demo models' ("The noun X means ... For example: ..."), from
    WordNet: the sensitive words above plus a hash-chosen sample of other nouns and verbs."""
    by_word: dict[str, str] = {}
    for pos, name in (("noun", "data.noun"), ("verb", "data.verb"), ("adjective", "data.adj")):
        for line in (WORDNET_DIR / name).read_text(encoding="utf-8").splitlines():
            if line.startswith(" ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            word = fields.split()[4].lower()
            if not re.fullmatch(r"[a-z]{3,14}", word) or word in by_word:
                continue  # the first (most common) sense of each word only
            parts = [p.strip() for p in gloss.split(";") if p.strip()]
            meaning = parts[0].rstrip(".") if parts else ""
            examples = [p.strip('"') for p in parts[1:] if p.startswith('"')]
            if not meaning or len(meaning) > 160:
                continue
            text = f"The {pos} {word} means {meaning}."
            if examples:
                text += f' For example: "{examples[0][:1].upper()}{examples[0][1:].rstrip(".")}."'
            by_word[word] = text
    chosen = [by_word[w] for w in SENSITIVE_WORDS if w in by_word]
    rest = sorted((w for w in by_word if w not in SENSITIVE_WORDS), key=lambda w: hashlib.sha1(w.encode()).digest())
    chosen += [by_word[w] for w in rest[: NUM_DEFINITIONS - len(chosen)]]
    return [_demo_record(t, "wordnet") for t in chosen]


def read_fortunes() -> list[dict]:
    """Short fortunes (as the demo models tell them), a hash-chosen sample."""
    fortunes = []
    for name in FORTUNE_FILES:
        for raw in (FORTUNES_DIR / name).read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            text = " ".join(raw.strip("%\n").split())
            if 30 <= len(text) <= 300 and not _FORTUNE_SKIP_RE.search(text):
                fortunes.append(text)
    fortunes = sorted(set(fortunes), key=lambda t: hashlib.sha1(t.encode()).digest())
    return [_demo_record(t, "fortunes") for t in fortunes[:NUM_FORTUNES]]


def read_demo_replies() -> list[dict]:
    """The demo models' canned replies (greetings, who they are, polite refusals): the text
    they send most often, so a false block there would show on almost every chat."""
    from scripts.demo_model.smalltalk import CANNED_GROUPS, REFUSALS, UNKNOWN_WORD

    replies = [reply for _, group_replies in CANNED_GROUPS for reply in group_replies]
    replies += [*REFUSALS, *UNKNOWN_WORD]
    words = ("harbor", "serendipity", "flow", "appreciate")
    texts = {reply.format(word=words[i % len(words)], unknown="zymurgy") for i, reply in enumerate(replies)}
    # The output filter judges an answer while it streams, so it reads these replies' openings
    # too ("I am a tiny demo model that ships with this" was blocked as malware): train on them.
    texts |= {prefix for text in list(texts) for prefix in _openings(text)}
    return [_demo_record(t, "demo_smalltalk") for t in sorted(texts)]


def _openings(text: str, step: int = 4, min_words: int = 6) -> list[str]:
    """The text cut after min_words words, then every step words (never the whole text)."""
    words = text.split()
    return [" ".join(words[:n]) for n in range(min_words, len(words), step)]


def _demo_record(text: str, source: str) -> dict:
    return {"kind": "response", "label": "benign", "topic": TOPIC_DEMO_TEXT, "turns": [text], "source": source}


def split(records: list[dict]) -> list[dict]:
    """Assign `id` and `split`: a record is held out when its id, read as a number, is 1 mod 4
    (about a quarter of every group, chosen without looking at the text, and stable: adding
    records never moves another one between the splits)."""
    for r in records:
        r["id"] = record_id(r["turns"])
        r["split"] = "heldout" if int(r["id"], 16) % 4 == 1 else "train"
        if r["source"] == "demo_smalltalk":
            # The demo models' fixed replies, sent word for word on most chats: all trained on.
            # How the filter treats the models' answers in general is measured on the answers
            # sampled from them (demo_answers.jsonl), which are never trained on.
            r["split"] = "train"
    return records


def normalized(turns: list[str]) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", "", " ".join(turns).lower()).split())


def check(kept: dict[str, list[dict]], added: list[dict]) -> None:
    """No duplicate ids or texts anywhere; no added record is a near-copy (word-set Jaccard
    >= NEAR_HELDOUT) of a held-out record on the other side of the split or of any original
    held-out record, so that nothing trained on paraphrases a held-out record."""
    ids, texts = set(), set()
    for r in [*kept["train"], *kept["heldout"], *added]:
        key = normalized(r["turns"])
        if r["id"] in ids or key in texts:
            raise SystemExit(f"duplicate record {r['id']}: {r['turns']}")
        ids.add(r["id"])
        texts.add(key)
    heldout = [(set(normalized(r["turns"]).split()), r) for r in [*kept["heldout"], *added] if r["split"] == "heldout"]
    for r in added:
        words = set(normalized(r["turns"]).split())
        for other_words, other in heldout:
            if other is r or (r["split"] == "heldout" and "source" in other):
                continue  # itself; two added held-out records may be alike
            if len(words & other_words) >= NEAR_HELDOUT * len(words | other_words):
                raise SystemExit(f"record {r['id']} {r['turns']} is close to held-out {other['id']}")


def main() -> int:
    kept, kept_lines = {}, {}
    for name in ("train", "heldout"):
        lines = (DATA_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        kept_lines[name] = [line for line in lines if "source" not in json.loads(line)]
        kept[name] = [json.loads(line) for line in kept_lines[name]]
    added = split(read_sources() + read_definitions() + read_fortunes() + read_demo_replies())
    check(kept, added)
    for name in ("train", "heldout"):
        new = sorted((r for r in added if r["split"] == name), key=lambda r: (r["source"], r["id"]))
        fields = ("id", "split", "kind", "label", "topic", "turns", "source")
        rows = [json.dumps({k: r[k] for k in fields}, ensure_ascii=False) for r in new]
        text = "".join(line + "\n" for line in kept_lines[name] + rows)
        (DATA_DIR / f"{name}.jsonl").write_text(text, encoding="utf-8")
        print(f"{name}.jsonl: {len(kept[name])} kept + {len(new)} added records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
