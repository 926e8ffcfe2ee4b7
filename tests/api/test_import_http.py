"""Importing conversations: POST /v1/conversations/import takes what the JSON exports write (one
conversation, or all of them) and stores them as new conversations of the caller's organisation
(new ids; titles, metadata, times and messages in order), all or none, checked whole before any
write (a 400 naming the field and the limit), held to the tier's storage cap, one request against
the rate limit; an export imported elsewhere exports again as the same conversations."""

from __future__ import annotations

import threading
import time

import orjson
import pytest

from api import conversation_import, import_document
from store import conversations as store_conversations
from tests.api.helpers import assert_error, state_of
from tests.api.test_export_http import create
from tests.api.test_files_http import other_org_headers, upload
from tests.api.test_images_http import data_url, png_bytes

IMPORT = "/v1/conversations/import"
# What an import keeps of a message; the ledger's usage and the feedback stay with the server that billed them.
KEPT = ("role", "content", "created_at", "tokens", "model", "parts", "finish_reason")


async def export_all(client, headers=None) -> dict:
    resp = await client.get("/v1/conversations/export", headers=headers or {})
    assert resp.status == 200, await resp.text()
    return orjson.loads(await resp.read())


async def post_import(client, document: object, headers=None):
    return await client.post(
        IMPORT, data=orjson.dumps(document), headers={"Content-Type": "application/json", **(headers or {})}
    )


async def imported(client, document: object, headers=None) -> dict:
    resp = await post_import(client, document, headers)
    assert resp.status == 201, await resp.text()
    return await resp.json()


def kept(conversation: dict) -> dict:
    """A conversation as an import keeps it: everything but ids, usage, feedback and attachment names."""
    return {
        "title": conversation["title"],
        "metadata": conversation["metadata"],
        "created_at": conversation["created_at"],
        "updated_at": conversation["updated_at"],
        "messages": [{k: m.get(k) for k in KEPT} for m in conversation["messages"]],
    }


def document(*conversations: dict) -> dict:
    return {"object": "list", "data": list(conversations)}


def conversation(*messages: dict, **fields) -> dict:
    return {"object": "conversation", "title": "T", "messages": list(messages), **fields}


def message(role: str = "user", content: str = "hi", **fields) -> dict:
    return {"role": role, "content": content, **fields}


async def listed_ids(client, headers=None) -> list[str]:
    body = await (await client.get("/v1/conversations", params={"limit": 100}, headers=headers or {})).json()
    return [c["id"] for c in body["data"]]


async def test_an_export_imported_into_another_organisation_exports_again_as_the_same_conversations(make_client):
    client = await make_client()
    file_id = (await (await upload(client, b"the minutes", filename="minutes.txt")).json())["id"]
    plain = await create(client, "Plain", "question", "answer")
    assert (await client.patch(f"/v1/conversations/{plain['id']}", json={"metadata": {"topic": "bread"}})).status == 200
    with_files = await create(client, "With files")
    parts = [
        {"type": "text", "text": "Read these."},
        {"type": "file", "file": {"file_id": file_id}},
        {"type": "file", "file": {"filename": "inline.txt", "file_data": "data:text/plain;base64,aGVsbG8="}},
    ]
    for content in (parts, "And then?"):
        turn = {
            "model": "echo",
            "messages": [{"role": "user", "content": content}],
            "conversation_id": with_files["id"],
        }
        assert (await client.post("/v1/chat/completions", json=turn)).status == 200
    await create(client, None)  # empty and untitled
    source = await export_all(client)
    assert len(source["data"]) == 3

    other = await other_org_headers(client)
    result = await imported(client, source, other)

    assert (result["object"], result["num_conversations"], result["num_messages"]) == ("conversation.import", 3, 6)
    assert [c["imported_from"] for c in result["data"]] == [c["id"] for c in source["data"]]
    assert result["unavailable_file_ids"] == [file_id]  # the other organisation has no such upload
    again = await export_all(client, other)
    assert [c["id"] for c in again["data"]] == [c["id"] for c in result["data"]]  # the same order
    assert not {c["id"] for c in again["data"]} & {c["id"] for c in source["data"]}  # new ids
    assert [kept(c) for c in again["data"]] == [kept(c) for c in source["data"]]
    answer = again["data"][1]["messages"][1]
    assert (answer["model"], answer["finish_reason"], answer["tokens"]) == ("echo", "length", 64)
    assert "usage" not in answer  # nothing billed here
    assert again["data"][1]["messages"][0]["attachments"] == [file_id, "inline.txt"]  # no file of its own: the id
    assert (await export_all(client))["data"] == source["data"]  # the source organisation is as it was


async def test_one_exported_conversation_imports_as_one_and_errors_name_its_fields_without_data(make_client):
    client = await make_client()
    conv = await create(client, "Single", "question", "answer")
    exported = orjson.loads(await (await client.get(f"/v1/conversations/{conv['id']}/export?format=json")).read())
    result = await imported(client, exported)
    assert [c["imported_from"] for c in result["data"]] == [conv["id"]]
    copy = await (await client.get(f"/v1/conversations/{result['data'][0]['id']}")).json()
    assert kept(copy) == kept(exported)

    exported["messages"][1]["role"] = "narrator"
    err = await assert_error(await post_import(client, exported), 400, param="messages[1].role")
    assert "user, assistant, system, developer, tool" in err["message"] and "'narrator'" in err["message"]


async def test_importing_into_the_same_organisation_adds_copies_and_never_touches_the_originals(make_client):
    client = await make_client()
    original = await create(client, "Original", "kept as it is")
    source = await export_all(client)
    source["data"][0]["title"] = "Changed in the file"
    result = await imported(client, source)
    copy_id = result["data"][0]["id"]
    assert copy_id != original["id"]
    assert sorted(await listed_ids(client)) == sorted([original["id"], copy_id])
    shown = await (await client.get(f"/v1/conversations/{original['id']}")).json()
    assert shown["title"] == "Original"


async def test_imported_conversations_belong_to_the_caller_alone(make_client):
    client = await make_client()
    other = await other_org_headers(client)
    result = await imported(client, document(conversation(message(content="only mine"), title="Mine")), other)
    cid = result["data"][0]["id"]
    assert await listed_ids(client) == []
    await assert_error(await client.get(f"/v1/conversations/{cid}"), 404, param="conversation_id")
    found = await client.get("/v1/conversations", params={"q": "only mine"})
    assert (await found.json())["data"] == []
    assert await listed_ids(client, other) == [cid]


async def test_search_finds_the_imported_text(make_client):
    client = await make_client()
    doc = document(conversation(message(content="a recipe for sourdough"), message("assistant", "with rye flour")))
    cid = (await imported(client, doc))["data"][0]["id"]
    body = await (await client.get("/v1/conversations", params={"q": "rye flo"})).json()
    assert [(hit["id"], hit["snippet"]) for hit in body["data"]] == [(cid, "with rye flour")]


async def test_titles_metadata_and_times_are_kept_and_a_time_from_the_future_is_now(make_client):
    client = await make_client()
    future = int(time.time()) + 86_400
    doc = document(
        conversation(
            message(created_at=1_600_000_000), title="Old", created_at=1_600_000_000, updated_at=1_600_000_100
        ),
        conversation(message(created_at=future), title="Future", metadata={"k": "v"}, created_at=future),
    )
    before = time.time()
    old, new = (await imported(client, doc))["data"]
    assert (old["title"], old["created_at"], old["updated_at"], old["metadata"]) == (
        "Old",
        1_600_000_000,
        1_600_000_100,
        {},
    )
    assert new["metadata"] == {"k": "v"}
    assert before - 1 <= new["created_at"] <= time.time() and new["updated_at"] <= time.time()
    shown = await (await client.get(f"/v1/conversations/{new['id']}")).json()
    assert shown["messages"][0]["created_at"] <= time.time()
    assert await listed_ids(client) == [new["id"], old["id"]]  # newest updated first, as any


async def test_conversations_of_one_second_list_in_the_files_order(make_client):
    client = await make_client()
    doc = document(
        *(conversation(message(), title=f"C{i}", created_at=1_700_000_000, updated_at=1_700_000_000) for i in range(5))
    )
    result = await imported(client, doc)
    ids = [c["id"] for c in result["data"]]
    assert [c["id"] for c in (await export_all(client))["data"]] == ids
    assert await listed_ids(client) == ids


@pytest.mark.parametrize(
    ("doc", "param", "words"),
    [
        ([], None, "JSON object"),
        ({"object": "thread", "data": []}, "object", "'list'"),
        ({"object": "list", "data": {}}, "data", "array"),
        (document("nope"), "data[0]", "conversation object"),
        (document(conversation(), {"title": "no messages"}), "data[1].messages", "array"),
        (document(conversation("hi")), "data[0].messages[0]", "message object"),
        (document(conversation(message("robot"))), "data[0].messages[0].role", "'robot'"),
        (
            document(conversation(message(content=[{"type": "text", "text": "x"}]))),
            "data[0].messages[0].content",
            "string",
        ),
        (document(conversation(message(), title="x" * 201)), "data[0].title", "at most 200"),
        (document(conversation(message(), title=7)), "data[0].title", "string or null"),
        (document(conversation(message(), metadata={"k": 1})), "data[0].metadata.k", "string"),
        (document(conversation(message(), created_at=-1)), "data[0].created_at", "unix time"),
        (document(conversation(message(), updated_at="yesterday")), "data[0].updated_at", "unix time"),
        (document(conversation(message(created_at=True))), "data[0].messages[0].created_at", "unix time"),
        (document(conversation(message("assistant", model=["echo"]))), "data[0].messages[0].model", "model's name"),
        (document(conversation(message("assistant", model="m" * 257))), "data[0].messages[0].model", "at most 256"),
        (document(conversation(message("assistant", tokens=-1))), "data[0].messages[0].tokens", "whole number"),
        (
            document(conversation(message("assistant", finish_reason="done"))),
            "data[0].messages[0].finish_reason",
            "stop",
        ),
        (
            document(conversation(message("assistant", parts=[{"type": "text", "text": "x"}]))),
            "data[0].messages[0].parts",
            "only user",
        ),
        (
            document(conversation(message(parts=[{"type": "video"}]))),
            "data[0].messages[0].parts[0]",
            "text, file or image_url",
        ),
        (
            document(conversation(message(parts=[{"type": "file", "file": {"file_data": "nope"}}]))),
            "data[0].messages[0].parts[0].file.file_data",
            "data: URL",
        ),
    ],
)
async def test_a_bad_document_is_a_400_naming_the_field_and_nothing_is_stored(make_client, doc, param, words):
    client = await make_client()
    err = await assert_error(await post_import(client, doc), 400, param=param)
    assert words in err["message"], err
    assert await listed_ids(client) == []


@pytest.mark.parametrize(
    ("part", "param", "code"),
    [
        (
            {"type": "file", "file": {"filename": "notes.pdf", "file_data": "data:application/pdf;base64,QUFBQQ=="}},
            "data[0].messages[0].parts[1].file.file_data",
            "unreadable_file",
        ),
        ({"type": "image_url", "image_url": {"url": data_url(b"not a picture")}}, "data[0].messages[0].parts[1]", None),
    ],
)
async def test_an_attachment_no_turn_could_read_is_a_400_naming_its_part_and_nothing_is_stored(
    make_client, part, param, code
):
    """A turn reads its conversation's attachments again each time: an imported inline file or image
    that cannot be read (a turn sending it is refused) made every later turn of it a 400."""
    client = await make_client()
    doc = document(conversation(message(parts=[{"type": "text", "text": "Read this."}, part]), message("assistant")))
    err = await assert_error(await post_import(client, doc), 400, param=param, code=code)
    assert "cannot" in err["message"]
    assert await listed_ids(client) == []
    readable = [
        {"type": "text", "text": "Read this."},
        {"type": "file", "file": {"filename": "notes.txt", "file_data": "data:text/plain;base64,aGVsbG8="}},
        {"type": "image_url", "image_url": {"url": data_url(png_bytes())}},
    ]
    doc = document(conversation(message(parts=readable), message("assistant")))
    cid = (await imported(client, doc))["data"][0]["id"]
    turn = {"model": "echo", "messages": [{"role": "user", "content": "And then?"}], "conversation_id": cid}
    resp = await client.post("/v1/chat/completions", json=turn)
    assert resp.status == 200, await resp.text()


async def test_one_bad_conversation_leaves_the_good_ones_before_it_unwritten(make_client):
    client = await make_client()
    doc = document(
        conversation(message(content="good")), conversation(message(content="fine")), conversation(message("x"))
    )
    await assert_error(await post_import(client, doc), 400, param="data[2].messages[0].role")
    assert await listed_ids(client) == []


async def test_text_longer_than_a_prompt_may_be_is_a_400_with_the_limit(make_client):
    client = await make_client("server.max_prompt_chars=100")
    doc = document(conversation(message(content="x" * 100), message("assistant", "y" * 101)))
    err = await assert_error(await post_import(client, doc), 400, code="string_above_max_length")
    assert err["param"] == "data[0].messages[1].content"
    assert "101 characters" in err["message"] and "100 (server.max_prompt_chars)" in err["message"]
    assert await listed_ids(client) == []


async def test_too_many_conversations_or_messages_is_a_400_with_the_limit(make_client, monkeypatch):
    monkeypatch.setattr(import_document, "MAX_IMPORT_CONVERSATIONS", 2)
    monkeypatch.setattr(import_document, "MAX_IMPORT_MESSAGES", 3)
    client = await make_client()
    three = document(*(conversation(message()) for _ in range(3)))
    err = await assert_error(await post_import(client, three), 400, param="data", code="array_above_max_length")
    assert "3 conversations" in err["message"] and "at most 2" in err["message"]
    four_messages = document(
        conversation(message(), message("assistant")), conversation(message(), message("assistant"))
    )
    err = await assert_error(await post_import(client, four_messages), 400, code="array_above_max_length")
    assert err["param"] == "data[1].messages" and "at most 3" in err["message"]
    assert await listed_ids(client) == []
    assert (await imported(client, document(conversation(message()), conversation(message(), message()))))[
        "num_messages"
    ] == 3


async def test_a_body_that_is_not_json_or_too_large_is_refused(make_client):
    client = await make_client()  # server.max_body_bytes=20000
    resp = await client.post(IMPORT, data=b'{"object": "list", "data": [', headers={"Content-Type": "application/json"})
    await assert_error(resp, 400, code="invalid_json")
    big = document(conversation(message(content="x" * 25_000)))
    await assert_error(await post_import(client, big), 413, code="request_too_large")
    assert await listed_ids(client) == []


async def test_an_import_past_the_storage_cap_is_refused_whole_with_the_caps_error(make_client):
    client = await make_client("tiers.enterprise.conversation_storage_bytes=1000")
    await imported(client, document(conversation(message(content="x" * 600))))
    doc = document(conversation(message(content="y" * 200)), conversation(message(content="z" * 300)))
    err = await assert_error(await post_import(client, doc), 400, code="conversation_quota_exceeded")
    assert "600 characters of the 1,000" in err["message"] and "would add 500" in err["message"]
    assert len(await listed_ids(client)) == 1
    inline = {"type": "file", "file": {"file_data": "data:text/plain;base64," + "QUFB" * 100}}
    with_parts = document(conversation(message(content="", parts=[inline])))  # parts count as stored characters
    await assert_error(await post_import(client, with_parts), 400, code="conversation_quota_exceeded")
    await imported(client, document(conversation(message(content="w" * 400))))  # what still fits
    assert len(await listed_ids(client)) == 2


async def test_a_write_that_fails_midway_leaves_nothing(make_client, monkeypatch):
    client = await make_client()
    real = store_conversations._insert_messages
    calls = 0

    async def fail_on_the_second(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("disk on fire")
        await real(*args, **kwargs)

    monkeypatch.setattr(store_conversations, "_insert_messages", fail_on_the_second)
    doc = document(conversation(message(content="first")), conversation(message(content="second")))
    await assert_error(await post_import(client, doc), 500)
    monkeypatch.setattr(store_conversations, "_insert_messages", real)
    assert await listed_ids(client) == []
    assert (await (await client.get("/v1/conversations", params={"q": "first"})).json())["data"] == []
    assert state_of(client).store.is_writable
    assert (await imported(client, doc))["num_conversations"] == 2


async def test_import_is_one_request_against_the_rate_limit_however_many_it_holds(make_client):
    client = await make_client("tiers.enterprise.requests_per_minute=2")
    many = document(*(conversation(message()) for _ in range(5)))
    for _ in range(2):
        assert (await imported(client, many))["num_conversations"] == 5
    await assert_error(await post_import(client, many), 429, code="rate_limit_exceeded")
    assert len(await listed_ids(client)) == 10


async def test_a_big_document_is_checked_on_a_worker_thread_and_a_small_one_on_the_loop(make_client, monkeypatch):
    client = await make_client("server.max_body_bytes=1000000")
    threads = []

    def recording(*args):
        threads.append(threading.current_thread() is threading.main_thread())
        return import_document.parse_document(*args)

    monkeypatch.setattr(conversation_import, "parse_document", recording)
    await imported(client, document(conversation(message(content="small"))))
    big = document(*(conversation(message(content="x" * 1000), message("assistant", "y" * 1000)) for _ in range(50)))
    assert (await imported(client, big))["num_messages"] == 100
    assert threads == [True, False]  # the loop serves other streams meanwhile
