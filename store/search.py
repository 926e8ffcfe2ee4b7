"""SQL for finding an organisation's conversations by what their titles and messages say.

The FTS5 indexes it reads (`message_search`, `title_search`: schema 13 in store/schema.py, kept
by triggers) span every organisation, so every query here joins `conversations` on `org_id` and
`deleted_at IS NULL`, as store/conversations.py does: another organisation's conversation, or a
deleted one, is never found. The user's text is matched as literal text, never as FTS5 syntax.
"""

from __future__ import annotations

import re

import aiosqlite

from store.conversations import CONV_COLUMNS, PAGE_ORDER, conversation_of, page_after
from store.rows import fetch_all
from store.types import ConversationHit

MIN_MATCH_CHARS = 3  # the trigram tokenizer's unit: shorter text is looked for in titles only
SNIPPET_CHARS = 160  # the most of a message's text a hit shows around the match, ellipses aside
_WORD_CUT_CHARS = 16  # a snippet's ends move to a space this close, not to cut a word in two

# Each matching message and title of the organisation's live conversations; per conversation,
# its latest matching message (the bare `message_id` comes from the row of max(seq); -1: the
# title only, message_id NULL). One quoted FTS5 string matches as a substring, case-insensitively.
_MATCHED = f"""
WITH matched (conversation_id, message_id, seq) AS (
    SELECT m.conversation_id, m.id, m.seq FROM message_search JOIN messages m ON m.rowid = message_search.rowid
    WHERE message_search MATCH ?
    UNION ALL
    SELECT c.id, NULL, -1 FROM title_search JOIN conversations c ON c.rowid = title_search.rowid
    WHERE title_search MATCH ?
)
SELECT {CONV_COLUMNS}, h.message_id, max(h.seq) FROM matched h JOIN conversations c ON c.id = h.conversation_id
WHERE c.org_id = ? AND c.deleted_at IS NULL{{after}}
GROUP BY c.id ORDER BY {PAGE_ORDER} LIMIT ?
"""
# Under MIN_MATCH_CHARS: the titles alone, by LIKE (case-insensitive for ASCII letters only).
_TITLE_LIKE = f"""
SELECT {CONV_COLUMNS}, NULL AS message_id FROM conversations c
WHERE c.org_id = ? AND c.deleted_at IS NULL AND c.title LIKE ? ESCAPE '\\'{{after}}
ORDER BY {PAGE_ORDER} LIMIT ?
"""


async def search_page(
    conn: aiosqlite.Connection, org_id: str, text: str, limit: int, after: str | None
) -> tuple[list[ConversationHit], bool]:
    """The organisation's conversations whose title or messages contain `text` (no NUL), newest
    first by (updated_at, id) as listed, a page at a time; `after` is the last id of the previous
    page (NotFound if it is no conversation of the organisation)."""
    after_sql, after_params = await page_after(conn, org_id, after)
    if len(text) < MIN_MATCH_CHARS:
        pattern = "%" + re.sub(r"([\\%_])", r"\\\1", text) + "%"
        sql, params = _TITLE_LIKE.format(after=after_sql), [org_id, pattern]
    else:
        match = '"' + text.replace('"', '""') + '"'  # one FTS5 string: no operator, column filter or prefix
        sql, params = _MATCHED.format(after=after_sql), [match, match, org_id]
    rows = await fetch_all(conn, sql, [*params, *after_params, limit + 1])
    found = [(conversation_of(r), r["message_id"]) for r in rows[:limit]]
    texts = await _message_texts(conn, [mid for _, mid in found if mid is not None])
    hits = [ConversationHit(conv, mid, snippet(texts[mid], text) if mid in texts else None) for conv, mid in found]
    return hits, len(rows) > limit


async def _message_texts(conn: aiosqlite.Connection, message_ids: list[str]) -> dict[str, str]:
    if not message_ids:
        return {}
    marks = ", ".join("?" * len(message_ids))
    rows = await fetch_all(conn, f"SELECT id, content FROM messages WHERE id IN ({marks})", message_ids)
    return {r["id"]: r["content"] for r in rows}


def snippet(content: str, text: str, max_chars: int = SNIPPET_CHARS) -> str:
    """About `max_chars` of `content` around the first case-insensitive match of `text` (a third
    of the room before it), whitespace collapsed, with an ellipsis where it was cut; from the start
    where Python's case folding finds no match that SQLite's did."""
    found = re.search(re.escape(text), content, re.IGNORECASE)
    start, end = (found.start(), found.end()) if found else (0, 0)
    lo = max(0, start - max(0, max_chars - (end - start)) // 3)
    hi = min(len(content), lo + max_chars)
    lo = max(0, min(lo, hi - max_chars))
    if lo > 0:  # begin at a word, unless the nearest space is inside the match
        space = content.find(" ", lo, min(start, lo + _WORD_CUT_CHARS))
        lo = space + 1 if space >= 0 else lo
    if hi < len(content):  # end at a word, unless that would cut into the match
        space = content.rfind(" ", max(end, hi - _WORD_CUT_CHARS), hi)
        hi = space if space >= 0 else hi
    piece = " ".join(content[lo:hi].split())
    return ("\u2026" if lo > 0 else "") + piece + ("\u2026" if hi < len(content) else "")
