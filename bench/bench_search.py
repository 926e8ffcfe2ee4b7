"""What conversation search costs (GET /v1/conversations?q=, store/search.py): the size of its
FTS5 indexes on a realistic database, and how long a search takes. Not part of `make bench`
(no model, no torch; a few seconds): `python -m bench.bench_search [--conversations 2000]`.

The database is the store's own (schema and triggers from store/schema.py): conversations of 10
messages, user turns of 50-250 characters and answers of 200-800, windows of this repository's
English prose (README, docs, bench/RESULTS.md), written one turn (2 messages) per transaction as
the server writes them, so the index is as the triggers grow it; then sizes again after FTS5's
`optimize`, and the alternatives that schema 13's comment weighs, built beside it: unicode61
(words, not substrings) and trigram with `detail=column` (no phrase queries). Sizes are from
SQLite's dbstat (pages of each table and its shadow tables). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.logs import configure_logging  # noqa: E402
from settings import StoreConfig  # noqa: E402
from store.store import Store  # noqa: E402

MESSAGES_PER_CONVERSATION = 10
QUERIES = ("engine", "prefix cache", "the", "tokens/s", "zqxjv", "KV")  # common, phrase, everywhere, rare, none, short
NUM_QUERY_RUNS = 20
ALTERNATIVES = {
    "unicode61": "fts5(content, content='messages', tokenize='unicode61 remove_diacritics 2')",
    "trigram_detail_column": "fts5(content, content='messages', tokenize='trigram', detail=column)",
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def corpus_words() -> list[str]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]
    return " ".join(p.read_text() for p in paths).split()


def text_of(words: list[str], rng: random.Random, min_chars: int, max_chars: int) -> str:
    """A window of the corpus about `min_chars`-`max_chars` characters long."""
    target = rng.randint(min_chars, max_chars)
    i = rng.randrange(0, len(words) - 500)
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < target:
        out.append(words[i])
        i += 1
    return " ".join(out)


def fill(path: Path, num_conversations: int, seed: int) -> int:
    """Writes the conversations through the schema's triggers; returns the characters of message text."""
    words, rng = corpus_words(), random.Random(seed)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")  # the bench measures sizes, not fsyncs
    org_id = conn.execute("SELECT id FROM orgs").fetchone()[0]
    num_chars, now = 0, time.time()
    for i in range(num_conversations):
        cid = f"conv_{i:024x}"
        title = text_of(words, rng, 20, 70)
        conn.execute(
            "INSERT INTO conversations (id, org_id, title, created_at, updated_at) VALUES (?, ?, ?, ?, ?)",
            (cid, org_id, title, now + i, now + i),
        )
        for seq in range(0, MESSAGES_PER_CONVERSATION, 2):  # one turn a transaction
            turn = [("user", text_of(words, rng, 50, 250)), ("assistant", text_of(words, rng, 200, 800))]
            conn.execute("BEGIN")
            for j, (role, content) in enumerate(turn):
                conn.execute(
                    "INSERT INTO messages (id, conversation_id, seq, role, content, created_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (f"msg_{i:012x}{seq + j:012x}", cid, seq + j, role, content, now + i),
                )
                num_chars += len(content)
            conn.execute("COMMIT")
    conn.close()
    return num_chars


def sizes(path: Path) -> dict[str, int]:
    """Bytes of pages per table, an FTS5 table's shadow tables counted with it."""
    with sqlite3.connect(path) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE sql LIKE 'CREATE VIRTUAL TABLE%'")]
        rows = conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall()
    out: dict[str, int] = {}
    for name, num_bytes in rows:
        owner = next((t for t in tables if name == t or name.startswith(t + "_")), name)
        out[owner] = out.get(owner, 0) + int(num_bytes)
    return out


def optimize_and_add_alternatives(path: Path) -> None:
    with sqlite3.connect(path, isolation_level=None) as conn:
        for table in ("message_search", "title_search"):
            conn.execute(f"INSERT INTO {table} ({table}) VALUES ('optimize')")
        for name, spec in ALTERNATIVES.items():
            conn.execute(f"CREATE VIRTUAL TABLE alt_{name} USING {spec}")
            conn.execute(f"INSERT INTO alt_{name} (alt_{name}) VALUES ('rebuild')")
            conn.execute(f"INSERT INTO alt_{name} (alt_{name}) VALUES ('optimize')")


async def query_ms(store: Store, org_id: str) -> dict[str, dict]:
    """Median milliseconds of a first page (20 hits) per query, through Store.search_conversations."""
    out = {}
    for text in QUERIES:
        times, num_hits = [], 0
        for _ in range(NUM_QUERY_RUNS):
            start = time.perf_counter()
            hits, _more = await store.search_conversations(org_id, text, limit=20)
            times.append((time.perf_counter() - start) * 1000)
            num_hits = len(hits)
        out[text] = {"median_ms": round(statistics.median(times), 2), "hits_on_page": num_hits}
    return out


async def run(num_conversations: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.db"
        store = await Store.open(path, StoreConfig())
        org = await store.create_org("bench", "enterprise")
        await store.close()
        start = time.perf_counter()
        num_chars = fill(path, num_conversations, seed)
        fill_s = time.perf_counter() - start
        grown = sizes(path)
        store = await Store.open(path, StoreConfig())
        try:
            latency = await query_ms(store, org.id)
        finally:
            await store.close()
        optimize_and_add_alternatives(path)
        optimized = sizes(path)
        file_bytes = path.stat().st_size
    return {
        "conversations": num_conversations,
        "messages": num_conversations * MESSAGES_PER_CONVERSATION,
        "message_chars": num_chars,
        "fill_s": round(fill_s, 1),
        "messages_table_bytes": grown["messages"],
        "as_grown": {k: grown[k] for k in ("message_search", "title_search")},
        "optimized": {k: v for k, v in optimized.items() if k.endswith("_search") or k.startswith("alt_")},
        "file_bytes_with_alternatives": file_bytes,
        "query": latency,
        "cpu": cpu_name(),
        "sqlite": sqlite3.sqlite_version,
    }


def report(result: dict) -> None:
    chars = result["message_chars"]
    print(
        f"{result['conversations']} conversations, {result['messages']} messages, {chars / 1e6:.1f} M characters"
        f" of message text (messages table {result['messages_table_bytes'] / 1e6:.1f} MB);"
        f" filled in {result['fill_s']} s"
    )
    print(f"{'index':<46}{'MB':>8}{'bytes/char':>12}")
    for label, group in (("as the triggers grew it", "as_grown"), ("after optimize", "optimized")):
        for name, num_bytes in result[group].items():
            print(f"{name + ' (' + label + ')':<46}{num_bytes / 1e6:>8.1f}{num_bytes / chars:>12.2f}")
    print(f"{'query':<20}{'median ms':>10}{'hits':>6}")
    for text, q in result["query"].items():
        print(f"{text!r:<20}{q['median_ms']:>10}{q['hits_on_page']:>6}")
    print(f"CPU: {result['cpu']}, SQLite {result['sqlite']}")
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    configure_logging("warning")
    report(asyncio.run(run(args.conversations, args.seed)))


if __name__ == "__main__":
    main()
