"""GET /v1/conversations?q=: the plain list's paging and shape, plus `message_id` and `snippet`;
only the caller's organisation's live conversations; cut messages not found; query syntax and odd
characters taken as text, never a 500; `q` bounded, blank `q` the plain list."""

from __future__ import annotations

import pytest

from api.resources import MAX_SEARCH_CHARS
from tests.api.helpers import assert_error, state_of


async def create(client, title: str | None = None, *texts: str) -> dict:
    """A conversation holding `texts` as alternating user and assistant messages."""
    roles = ("user", "assistant")
    items = [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]
    body = {"items": items, **({"title": title} if title else {})}
    resp = await client.post("/v1/conversations", json=body)
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def search(client, q: str, **params: str) -> dict:
    resp = await client.get("/v1/conversations", params={"q": q, **params})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_q_lists_matching_conversations_like_the_list_with_the_message_and_snippet(make_client):
    client = await make_client()
    by_title = await create(client, "Sourdough starter")
    by_text = await create(client, None, "How long should sourdough rise?", "About four to six hours.")
    await create(client, "Unrelated", "nothing here", "nor here")

    found = await search(client, "SOURDOUGH")
    assert [c["id"] for c in found["data"]] == [by_text["id"], by_title["id"]]  # newest first
    first = found["data"][0]
    assert first["message_id"] == by_text["messages"][0]["id"]
    assert first["snippet"] == "How long should sourdough rise?"
    listed = {c["id"]: c for c in (await (await client.get("/v1/conversations")).json())["data"]}
    assert {k: v for k, v in first.items() if k not in ("message_id", "snippet")} == listed[by_text["id"]]
    assert (found["data"][1]["message_id"], found["data"][1]["snippet"]) == (None, None)  # the title matched
    assert (found["object"], found["has_more"]) == ("list", False)
    assert (found["first_id"], found["last_id"]) == (by_text["id"], by_title["id"])

    answer = await search(client, "four to six")
    assert [(c["id"], c["message_id"]) for c in answer["data"]] == [(by_text["id"], by_text["messages"][1]["id"])]
    assert (await search(client, "no such words"))["data"] == []


async def test_a_chat_turn_is_found_and_a_truncated_one_is_not(make_client):
    client = await make_client()
    cid = (await create(client, "t"))["id"]
    body = {
        "model": "echo",
        "messages": [{"role": "user", "content": "Tell me about narwhals"}],
        "conversation_id": cid,
    }
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    hit = (await search(client, "narwhal"))["data"]
    assert [c["id"] for c in hit] == [cid] and hit[0]["snippet"] == "Tell me about narwhals"  # the echoed answer

    cut = await client.post(f"/v1/conversations/{cid}/truncate", json={"keep_messages": 0})
    assert cut.status == 200
    assert (await search(client, "narwhal"))["data"] == []


async def test_search_never_finds_another_organisations_or_a_deleted_conversation(make_client):
    client = await make_client()
    mine = await create(client, "Quarterly numbers", "the quarterly numbers are in")
    deleted = await create(client, "Quarterly draft", "old quarterly numbers")
    assert (await client.delete(f"/v1/conversations/{deleted['id']}")).status == 200
    store = state_of(client).store
    await store.create_org("other", "free")
    _key, secret = await store.create_key("other")
    other = {"Authorization": f"Bearer {secret}"}

    assert [c["id"] for c in (await search(client, "quarterly"))["data"]] == [mine["id"]]
    assert [c["id"] for c in (await search(client, "Qu"))["data"]] == [mine["id"]]  # short: titles
    for q in ("quarterly", "Qu"):
        resp = await client.get("/v1/conversations", params={"q": q}, headers=other)
        assert resp.status == 200 and (await resp.json())["data"] == []
    resp = await client.get("/v1/conversations", params={"q": "quarterly", "after": mine["id"]}, headers=other)
    await assert_error(resp, 404, param="after")


async def test_search_pages_with_limit_and_after_as_the_list_does(make_client):
    client = await make_client()
    made = [await create(client, f"Recipe {i}", f"recipe number {i}") for i in range(5)]
    await create(client, "Other", "something else")
    pages, after = [], None
    while True:
        page = await search(client, "recipe", limit="2", **({"after": after} if after else {}))
        pages.append([c["id"] for c in page["data"]])
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == [[m["id"] for m in made[::-1]][i : i + 2] for i in (0, 2, 4)]
    await assert_error(await client.get("/v1/conversations", params={"q": "recipe", "limit": "0"}), 400, param="limit")
    await assert_error(
        await client.get("/v1/conversations", params={"q": "recipe", "after": "conv_nope"}), 404, param="after"
    )


@pytest.mark.parametrize(
    "q",
    [
        '"',
        '"unbalanced quote',
        "NEAR(a b)",
        "a AND b OR c",
        "NOT this",
        "star*",
        "content: x",
        "title:x",
        "^caret",
        "{a b}: c",
        "(()",
        "%_\\",
        "'; DROP TABLE messages; --",
        "<b>bold</b>",
        "emoji 🦄 and 東京",
    ],
)
async def test_query_syntax_and_odd_characters_are_searched_as_text(make_client, q):
    client = await make_client()
    holder = await create(client, f"holder {q}", f"it said {q} here")
    await create(client, "decoy", "a b c this star x title caret bold")
    found = (await search(client, q))["data"]
    assert [c["id"] for c in found] == [holder["id"]]
    if len(q) >= 3:  # shorter text is looked for in titles only
        assert q in found[0]["snippet"]


async def test_q_is_bounded_and_blank_q_is_the_plain_list(make_client):
    client = await make_client()
    conv = await create(client, "kept")
    plain = await (await client.get("/v1/conversations")).json()
    assert await search(client, "   ") == plain and await search(client, "") == plain
    assert "snippet" not in plain["data"][0]
    assert (await search(client, "x" * MAX_SEARCH_CHARS))["data"] == []
    too_long = await client.get("/v1/conversations", params={"q": "x" * (MAX_SEARCH_CHARS + 1)})
    err = await assert_error(too_long, 400, param="q")
    assert str(MAX_SEARCH_CHARS) in err["message"]
    await assert_error(await client.get("/v1/conversations", params={"q": "a\x00bc"}), 400, param="q")
    for raw in ("%FF%FE", "%ED%A0%80abc", "%C3"):  # not UTF-8: never a 500
        resp = await client.get(f"/v1/conversations?q={raw}")
        assert resp.status in (200, 400), await resp.text()
    assert [c["id"] for c in (await search(client, " kept "))["data"]] == [conv["id"]]
