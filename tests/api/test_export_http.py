"""Exporting conversations: GET /v1/conversations/{id}/export as Markdown or JSON (the stored
messages, attachments by name, a safe filename from the title), 404 for another organisation's
or a deleted conversation, 400 for an unknown format; GET /v1/conversations/export streams every
live conversation of the caller's organisation and none of another's, as one request."""

from __future__ import annotations

import re
from urllib.parse import unquote

import orjson
import pytest

from api import export
from tests.api.helpers import assert_error, state_of
from tests.api.test_files_http import other_org_headers, upload


async def create(client, title: str | None, *texts: str, headers=None) -> dict:
    """A conversation holding `texts` as alternating user and assistant messages."""
    items = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
    resp = await client.post(
        "/v1/conversations", json={"items": items, **({"title": title} if title else {})}, headers=headers or {}
    )
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def export_one(client, cid: str, fmt: str, headers=None):
    return await client.get(f"/v1/conversations/{cid}/export", params={"format": fmt}, headers=headers or {})


def filename_of(resp) -> str:
    """The name a browser saves the download as: filename* (RFC 6266) first, else filename."""
    disposition = resp.headers["Content-Disposition"]
    assert disposition.startswith("attachment; ")
    extended = re.search(r"filename\*=UTF-8''([^;\s]+)", disposition)
    if extended:
        return unquote(extended.group(1))
    return re.search(r'filename="([^"]*)"', disposition).group(1)


async def test_markdown_export_has_the_title_each_speaker_and_the_text_as_written(make_client):
    client = await make_client()
    conv = await create(client, "Bread notes", "How do I *shape* a loaf?", "1. Fold\n2. Roll\n\n```\ntight\n```")
    turn = {"model": "echo", "messages": [{"role": "user", "content": "And then?"}], "conversation_id": conv["id"]}
    assert (await client.post("/v1/chat/completions", json=turn)).status == 200

    resp = await export_one(client, conv["id"], "markdown")
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"] == "text/markdown; charset=utf-8"
    assert filename_of(resp) == "Bread notes.md"
    assert await resp.text() == (
        "# Bread notes\n\n"
        "**User**\n\nHow do I *shape* a loaf?\n\n"
        "**Assistant**\n\n1. Fold\n2. Roll\n\n```\ntight\n```\n\n"
        "**User**\n\nAnd then?\n\n"
        "**Assistant (echo)**\n\nAnd then?\n"
    )
    default = await client.get(f"/v1/conversations/{conv['id']}/export")
    assert default.headers["Content-Type"] == "text/markdown; charset=utf-8"  # the default format


async def test_json_export_is_the_conversation_as_get_renders_it_with_attachment_names(make_client):
    client = await make_client()
    file_id = (await (await upload(client, b"the minutes", filename="minutes.txt")).json())["id"]
    conv = await create(client, "Meeting")
    parts = [
        {"type": "text", "text": "Read these."},
        {"type": "file", "file": {"file_id": file_id}},
        {"type": "file", "file": {"filename": "inline.txt", "file_data": "data:text/plain;base64,aGVsbG8="}},
    ]
    turn = {"model": "echo", "messages": [{"role": "user", "content": parts}], "conversation_id": conv["id"]}
    assert (await client.post("/v1/chat/completions", json=turn)).status == 200, "the turn is stored"

    resp = await export_one(client, conv["id"], "json")
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/json"
    assert filename_of(resp) == "Meeting.json"
    exported = orjson.loads(await resp.read())
    shown = await (await client.get(f"/v1/conversations/{conv['id']}")).json()
    user, answer = exported["messages"]
    assert user.pop("attachments") == ["minutes.txt", "inline.txt"]
    assert "attachments" not in answer
    assert exported == shown
    assert (exported["title"], user["role"], answer["model"]) == ("Meeting", "user", "echo")
    assert answer["content"].startswith("Read these.") and isinstance(answer["created_at"], int)

    markdown = await (await export_one(client, conv["id"], "markdown")).text()
    assert "**User**\n\nRead these.\n\nAttachments:\n\n- `minutes.txt`\n- `inline.txt`\n" in markdown


@pytest.mark.parametrize(
    ("title", "saved_as", "ascii_name"),
    [
        ("../../etc/passwd", "etc_passwd.md", "etc_passwd.md"),
        ('He said "hi"\nthen left', "He said _hi_ then left.md", "He said _hi_ then left.md"),
        ("C:\\Users\\me\\notes", "C_Users_me_notes.md", "C_Users_me_notes.md"),
        ("\U0001f999 Llama facts", "\U0001f999 Llama facts.md", "Llama facts.md"),
        ("r\u00e9sum\u00e9 \u202etxt.exe", "r\u00e9sum\u00e9 txt.exe.md", "resume txt.exe.md"),
        ("..", None, None),  # nothing left: the conversation's id
        ("x" * 200, "x" * 80 + ".md", "x" * 80 + ".md"),
    ],
)
async def test_the_filename_comes_from_the_title_without_paths_quotes_or_control_characters(
    make_client, title, saved_as, ascii_name
):
    client = await make_client()
    conv = await create(client, title, "hello")
    resp = await export_one(client, conv["id"], "markdown")
    assert resp.status == 200
    disposition = resp.headers["Content-Disposition"]
    assert disposition.isascii() and "\n" not in disposition and "\r" not in disposition
    plain = re.fullmatch(r'attachment; filename="([^"\\]*)"(?:; filename\*=UTF-8\'\'([A-Za-z0-9%._~-]+))?', disposition)
    assert plain is not None, disposition
    name = filename_of(resp)
    assert name == (saved_as or f"{conv['id']}.md")
    assert plain.group(1) == (ascii_name or f"{conv['id']}.md")
    assert "/" not in name and "\\" not in name and '"' not in name and not name.startswith(".")
    assert (plain.group(2) is None) == name.isascii()  # filename* only for a name that is not ASCII


async def test_another_organisations_or_a_deleted_conversation_is_not_found(make_client):
    client = await make_client()
    mine = await create(client, "Mine", "private words")
    gone = await create(client, "Gone", "deleted words")
    assert (await client.delete(f"/v1/conversations/{gone['id']}")).status == 200
    other = await other_org_headers(client)
    for fmt in ("markdown", "json"):
        await assert_error(await export_one(client, mine["id"], fmt, other), 404, param="conversation_id")
        await assert_error(await export_one(client, gone["id"], fmt), 404, param="conversation_id")
        await assert_error(await export_one(client, "conv_nope", fmt), 404, param="conversation_id")


async def test_an_unknown_format_is_a_400_naming_format(make_client):
    client = await make_client()
    conv = await create(client, "T", "hi")
    for fmt in ("pdf", "", "MARKDOWN"):
        err = await assert_error(await export_one(client, conv["id"], fmt), 400, param="format")
        assert "markdown or json" in err["message"]
    await assert_error(await client.get("/v1/conversations/export?format=markdown"), 400, param="format")


async def test_export_all_streams_every_live_conversation_newest_first_and_no_other_orgs(make_client, monkeypatch):
    monkeypatch.setattr(export, "PAGE_SIZE", 2)  # several pages, one ending exactly at the last
    client = await make_client()
    made = [await create(client, f"Chat {i}", f"question {i}", f"answer {i}") for i in range(6)]
    assert (await client.delete(f"/v1/conversations/{made[2]['id']}")).status == 200
    other = await other_org_headers(client)
    theirs = await create(client, "Theirs", "not yours", headers=other)
    # A new turn in an old conversation moves it up the list, never out of the export.
    turn = {"model": "echo", "messages": [{"role": "user", "content": "more"}], "conversation_id": made[0]["id"]}
    assert (await client.post("/v1/chat/completions", json=turn)).status == 200

    resp = await client.get("/v1/conversations/export")
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/json"
    assert filename_of(resp) == "conversations.json"
    body = orjson.loads(await resp.read())
    assert body["object"] == "list"
    expected = [c["id"] for c in made[::-1] if c is not made[2]]
    assert [c["id"] for c in body["data"]] == expected  # newest created first
    for conv in body["data"]:
        shown = await (await client.get(f"/v1/conversations/{conv['id']}")).json()
        assert conv == shown
    assert [m["content"] for m in body["data"][-1]["messages"]] == ["question 0", "answer 0", "more", "more"]

    theirs_all = orjson.loads(await (await client.get("/v1/conversations/export", headers=other)).read())
    assert [c["id"] for c in theirs_all["data"]] == [theirs["id"]]


async def test_export_all_of_nothing_is_an_empty_list(make_client):
    client = await make_client()
    resp = await client.get("/v1/conversations/export", params={"format": "json"})
    assert resp.status == 200
    assert orjson.loads(await resp.read()) == {"object": "list", "data": []}


async def test_export_all_counts_as_one_request_against_the_rate_limit(make_client):
    client = await make_client("tiers.enterprise.requests_per_minute=2")
    state = state_of(client)
    org_id = state.local_principal.org.id
    for i in range(3):  # made on the store: each POST would spend a request of the bucket
        await state.store.create_conversation(org_id, title=f"Chat {i}")
    for _ in range(2):
        resp = await client.get("/v1/conversations/export")
        assert resp.status == 200 and len(orjson.loads(await resp.read())["data"]) == 3
    await assert_error(await client.get("/v1/conversations/export"), 429, code="rate_limit_exceeded")
