"""Share links: POST /v1/conversations/{id}/shares makes a snapshot under an unguessable link that
GET /v1/shared/{token} (JSON) and GET /share/{token} (the page) serve without a key; later turns
stay out until the share is updated; only the organisation lists, updates and revokes its links;
unknown, revoked and deleted conversations' links are one and the same 404; attachments are named,
never served; snapshots count against the storage cap; sharing.enabled = false turns it all off.
Readers without a key are held per address: reads a minute (429), a share of the bytes being sent
(429), all of those bytes (503); readers through a trusted proxy only to the last."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import TYPE_CHECKING

import aiohttp
import orjson

from api import shares
from api.shares import MAX_SNAPSHOT_CHARS
from store.conversations import new_message_id
from store.types import Message
from tests.api.helpers import assert_error, org_headers, state_of
from tests.api.test_files_http import other_org_headers, upload

if TYPE_CHECKING:
    from api.share_readers import ShareReaders

PAGE_HEADERS = {"Cache-Control": "no-store", "X-Robots-Tag": "noindex, nofollow", "Referrer-Policy": "no-referrer"}


async def create(client, *texts: str, headers=None, system: str | None = None) -> dict:
    """A conversation holding `texts` as alternating user and assistant messages (after `system`)."""
    items = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
    if system is not None:
        items.insert(0, {"role": "system", "content": system})
    resp = await client.post("/v1/conversations", json={"items": items}, headers=headers or {})
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def share(client, cid: str, headers=None, **body) -> dict:
    resp = await client.post(f"/v1/conversations/{cid}/shares", json=body, headers=headers or {})
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def shared(client, token: str) -> dict:
    resp = await client.get(f"/v1/shared/{token}")
    assert resp.status == 200, await resp.text()
    assert {k: resp.headers.get(k) for k in ("Cache-Control", "X-Robots-Tag")} == {
        "Cache-Control": "no-store",
        "X-Robots-Tag": "noindex, nofollow",
    }
    return await resp.json()


async def test_a_share_is_created_listed_read_without_a_key_and_revoked(make_client):
    client = await make_client()
    conv = await create(client, "How do I *knead* dough?", "Fold it, **push** it, turn it.", system="Be brief.")
    made = await share(client, conv["id"])
    token = made["token"]
    assert made["object"] == "conversation.share" and made["id"].startswith("share_")
    assert made["conversation_id"] == conv["id"] and made["path"] == f"/share/{token}"
    assert made["url"] == f"http://127.0.0.1:{client.port}/share/{token}"  # the origin the caller reached
    assert len(token) == 32 and conv["id"][5:] not in token and made["id"][6:] not in token
    assert made["num_messages"] == 3 and made["last_message_id"] == conv["messages"][-1]["id"]

    snapshot = await shared(client, token)
    assert snapshot == {
        "object": "conversation.shared",
        "title": "How do I *knead* dough?",
        "created_at": made["snapshot_at"],
        "messages": [  # the system message is the organisation's instructions: not shown
            {"role": "user", "content": "How do I *knead* dough?"},
            {"role": "assistant", "content": "Fold it, **push** it, turn it.", "model": None},
        ],
    }
    listed = await (await client.get("/v1/shares")).json()
    assert [s["id"] for s in listed["data"]] == [made["id"]] and listed["has_more"] is False
    assert await (await client.get(f"/v1/shares/{made['id']}")).json() == made
    other = await create(client, "Another chat")
    await share(client, other["id"])
    narrowed = await (await client.get("/v1/shares", params={"conversation_id": conv["id"]})).json()
    assert [s["id"] for s in narrowed["data"]] == [made["id"]]

    revoked = await client.delete(f"/v1/shares/{made['id']}")
    assert await revoked.json() == {"id": made["id"], "object": "conversation.share.deleted", "deleted": True}
    await assert_error(await client.get(f"/v1/shared/{token}"), 404, code="share_not_found")
    assert (await client.get(f"/share/{token}")).status == 404
    await assert_error(await client.delete(f"/v1/shares/{made['id']}"), 404, param="share_id")
    assert [s["conversation_id"] for s in (await (await client.get("/v1/shares")).json())["data"]] == [other["id"]]


async def test_a_share_is_a_snapshot_later_turns_show_only_once_it_is_updated(make_client):
    client = await make_client()
    conv = await create(client, "First question", "First answer")
    made = await share(client, conv["id"])
    turn = {"model": "echo", "messages": [{"role": "user", "content": "A later turn"}], "conversation_id": conv["id"]}
    assert (await client.post("/v1/chat/completions", json=turn)).status == 200

    before = await shared(client, made["token"])
    assert [m["content"] for m in before["messages"]] == ["First question", "First answer"]
    updated = await (await client.post(f"/v1/shares/{made['id']}", json={})).json()
    assert updated["token"] == made["token"] and updated["num_messages"] == 4
    after = await shared(client, made["token"])
    contents = [m["content"] for m in after["messages"]]
    assert contents == ["First question", "First answer", "A later turn", "A later turn"]  # the echo answers it
    assert after["messages"][-1]["model"] == "echo"

    # An edit (truncate and resend) changes the conversation, never what a link already shows.
    first_answer = conv["messages"][1]["id"]
    upto = await share(client, conv["id"], message_id=first_answer)
    assert (upto["num_messages"], upto["last_message_id"]) == (2, first_answer)
    cut = {"keep_messages": 1}
    assert (await client.post(f"/v1/conversations/{conv['id']}/truncate", json=cut)).status == 200
    assert [m["content"] for m in (await shared(client, upto["token"]))["messages"]][-1] == "First answer"
    await assert_error(
        await client.post(f"/v1/shares/{upto['id']}", json={"message_id": first_answer}), 400, param="message_id"
    )


async def test_a_links_url_is_the_public_base_url_or_the_origin_the_caller_reached(make_client):
    client = await make_client()
    made = await share(client, (await create(client, "Where is it?"))["id"])
    page = f"/share/{made['token']}"
    url = f"/v1/shares/{made['id']}"
    assert (await (await client.get(url, headers={"Host": "localhost:9000"})).json())["url"] == (
        f"http://localhost:9000{page}"
    )
    assert (await (await client.get(url, headers={"Host": "[::1]"})).json())["url"] == f"http://[::1]{page}"
    listed = await (await client.get("/v1/shares", headers={"Host": "LOCALHOST"})).json()
    assert listed["data"][0]["url"] == f"http://localhost{page}"
    updated = await (await client.post(url, headers={"Host": "127.0.0.1:80"})).json()
    assert updated["url"] == f"http://127.0.0.1{page}" and updated["path"] == page
    await assert_error(await client.get(url, headers={"Host": "evil.example"}), 403, code="host_not_allowed")
    await client.close()

    # Any Host passes with allowed_hosts "*": the url holds only a host name and port rebuilt from it,
    # and a Host of another shape gives the address the connection came in on.
    star = await make_client('server.allowed_hosts=["*"]', "server.require_keys=true")
    headers = await org_headers(star, "acme", "enterprise")
    made = await share(star, (await create(star, "Hi", headers=headers))["id"], headers=headers)
    url, page = f"/v1/shares/{made['id']}", f"/share/{made['token']}"
    for host, origin in (
        ("chat.example.com", "http://chat.example.com"),
        ("[::1]:8443", "http://[::1]:8443"),
        ("[evil.example/x?]", f"http://127.0.0.1:{star.port}"),
        ("a.example, b.example", f"http://127.0.0.1:{star.port}"),
        ("x.example:99999", f"http://127.0.0.1:{star.port}"),
    ):
        got = await (await star.get(url, headers={**headers, "Host": host})).json()
        assert got["url"] == origin + page, host
    await star.close()

    public = await make_client('sharing.public_base_url="https://chat.example.com/"')
    made = await share(public, (await create(public, "Behind the proxy"))["id"])
    assert made["url"] == f"https://chat.example.com/share/{made['token']}"
    await public.close()

    # Behind a proxy that ends TLS: its X-Forwarded-Proto is the scheme, and only a listed proxy's.
    proxied = await make_client(
        'server.trusted_proxies=["127.0.0.1"]', "server.require_keys=true", 'server.allowed_hosts=["chat.example.com"]'
    )
    headers = await org_headers(proxied, "acme", "enterprise")
    made = await share(proxied, (await create(proxied, "Hi", headers=headers))["id"], headers=headers)
    url, page = f"/v1/shares/{made['id']}", f"/share/{made['token']}"
    forwarded = {**headers, "Host": "chat.example.com", "X-Forwarded-Proto": "https"}
    assert (await (await proxied.get(url, headers=forwarded)).json())["url"] == f"https://chat.example.com{page}"
    status, _, body = await get_from(proxied, "127.0.0.2", url, headers=forwarded)  # no proxy of ours
    assert status == 200 and orjson.loads(body)["url"] == f"http://chat.example.com{page}"


async def test_share_requests_are_checked_and_name_the_field(make_client):
    client = await make_client()
    conv = await create(client, "Hello", "Hi")
    url = f"/v1/conversations/{conv['id']}/shares"
    await assert_error(await client.post(url, json={"message_id": "msg_nope"}), 400, param="message_id")
    await assert_error(await client.post(url, json={"message_id": 3}), 400, param="message_id")
    await assert_error(await client.post(url, json={"title": "x"}), 400, code="unknown_parameter", param="title")
    await assert_error(await client.post(url, json=[]), 400)
    await assert_error(await client.post("/v1/conversations/conv_nope/shares"), 404, param="conversation_id")
    empty = await (await client.post("/v1/conversations", json={})).json()
    await assert_error(await client.post(f"/v1/conversations/{empty['id']}/shares"), 400, param="conversation_id")
    await assert_error(await client.get("/v1/shares", params={"after": "share_nope"}), 404, param="after")
    await assert_error(await client.get("/v1/shares", params={"limit": "0"}), 400, param="limit")
    assert (await client.post(url)).status == 201  # the body is optional


async def test_links_are_read_without_a_key_where_every_other_call_needs_one(make_client):
    client = await make_client("server.require_keys=true")
    headers = await org_headers(client, "acme", "enterprise")
    conv = await create(client, "Public question", "Public answer", headers=headers)
    made = await share(client, conv["id"], headers=headers)

    assert [m["content"] for m in (await shared(client, made["token"]))["messages"]] == [
        "Public question",
        "Public answer",
    ]
    page = await client.get(made["path"])
    assert page.status == 200 and page.content_type == "text/html"
    assert "share.js" in await page.text()
    assert {k: page.headers.get(k) for k in PAGE_HEADERS} == PAGE_HEADERS
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    # Everything else still needs the key: the organisation's list of links above all.
    await assert_error(await client.get("/v1/shares"), 401, code="invalid_api_key")
    await assert_error(await client.post(f"/v1/conversations/{conv['id']}/shares"), 401, code="invalid_api_key")
    await assert_error(await client.delete(f"/v1/shares/{made['id']}"), 401, code="invalid_api_key")
    await assert_error(await client.get(f"/v1/conversations/{conv['id']}"), 401, code="invalid_api_key")
    # The keyless prefix is no way around the key: dot segments are not resolved into another route.
    for target in ("/v1/shared/../conversations", "/v1/shared/%2e%2e/usage", "/v1/shared/x/../../shares"):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        status = (await reader.readline()).split()[1]
        writer.close()
        assert status == b"404", target


async def test_another_organisation_cannot_list_update_revoke_or_share_what_is_not_its_own(make_client):
    client = await make_client()
    conv = await create(client, "Our plans", "Kept between us")
    made = await share(client, conv["id"])
    mallory = await other_org_headers(client)

    await assert_error(
        await client.post(f"/v1/conversations/{conv['id']}/shares", headers=mallory), 404, param="conversation_id"
    )
    assert (await (await client.get("/v1/shares", headers=mallory)).json())["data"] == []
    listed = await client.get("/v1/shares", params={"conversation_id": conv["id"]}, headers=mallory)
    assert (await listed.json())["data"] == []
    for method in ("GET", "POST", "DELETE"):
        resp = await client.request(method, f"/v1/shares/{made['id']}", headers=mallory)
        await assert_error(resp, 404, param="share_id")
    assert (await shared(client, made["token"]))["messages"][0]["content"] == "Our plans"  # untouched
    assert [s["id"] for s in (await (await client.get("/v1/shares")).json())["data"]] == [made["id"]]


async def test_unknown_revoked_and_deleted_conversations_links_are_the_same_404(make_client):
    client = await make_client()
    revoked = await share(client, (await create(client, "Revoked"))["id"])
    assert (await client.delete(f"/v1/shares/{revoked['id']}")).status == 200
    conv = await create(client, "Deleted")
    deleted = await share(client, conv["id"])
    assert (await client.delete(f"/v1/conversations/{conv['id']}")).status == 200
    kept = await share(client, (await create(client, "Kept"))["id"])
    unknown = kept["token"][:-4] + ("AAAA" if not kept["token"].endswith("AAAA") else "BBBB")

    bodies, pages = [], []
    for token in (revoked["token"], deleted["token"], unknown, "short", "x" * 33, "no.such~token"):
        err = await assert_error(await client.get(f"/v1/shared/{token}"), 404, code="share_not_found")
        bodies.append(err)
        page = await client.get(f"/share/{token}")
        assert page.status == 404 and page.content_type == "text/html"
        pages.append(await page.text())
    assert all(b == bodies[0] for b in bodies) and "link" in bodies[0]["message"]
    assert all(p == pages[0] for p in pages)
    assert (await client.get(f"/share/{kept['token']}")).status == 200
    assert (await (await client.get("/v1/shares")).json())["data"][0]["id"] == kept["id"]
    assert len((await (await client.get("/v1/shares")).json())["data"]) == 1, "the deleted chat's link is gone"


async def test_a_share_names_attachments_but_never_carries_file_bytes_data_urls_or_file_ids(make_client):
    client = await make_client()
    kept_file = (await (await upload(client, b"the minutes", filename="minutes.txt")).json())["id"]
    gone_file = (await (await upload(client, b"secret bytes", filename="gone.txt")).json())["id"]
    assert (await client.delete(f"/v1/files/{gone_file}")).status == 200
    pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    parts = [
        {"type": "text", "text": "Read these."},
        {"type": "file", "file": {"file_id": kept_file}},
        {"type": "file", "file": {"file_id": gone_file}},
        {
            "type": "file",
            "file": {"filename": "inline.txt", "file_data": "data:text/plain;base64,aW5saW5lIHNlY3JldA=="},
        },
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pixel}"}},
        {"type": "image_url", "image_url": {"file_id": kept_file}},
    ]
    org = (await state_of(client).keyless_principal()).org
    message = Message(new_message_id(), "user", "Read these.", time.time(), parts_json=orjson.dumps(parts).decode())
    conv = await state_of(client).store.create_conversation(org.id, messages=(message,))
    made = await share(client, conv.id)

    resp = await client.get(f"/v1/shared/{made['token']}")
    raw = await resp.text()
    assert (await resp.json())["messages"] == [
        {
            "role": "user",
            "content": "Read these.",
            "attachments": ["minutes.txt", "file", "inline.txt", "image", "minutes.txt"],
        }
    ]
    for secret in ("data:", "base64", pixel[:20], "aW5saW5l", kept_file, gone_file, "file-", "parts"):
        assert secret not in raw, secret
    page = await (await client.get(made["path"])).text()
    assert "data:image/png" not in page and kept_file not in page
    # The file itself is still only for its organisation's keys.
    assert (await client.get(f"/v1/files/{kept_file}/content", headers=await other_org_headers(client))).status == 404


async def test_a_snapshot_past_the_size_a_link_serves_is_refused_and_an_earlier_one_can_be_shared(make_client):
    client = await make_client()  # the enterprise tier (keyless local): no storage cap to stop it first
    org = (await state_of(client).keyless_principal()).org
    roles = ["user", "assistant"] * 5  # 9,000,000 characters: past MAX_SNAPSHOT_CHARS
    messages = tuple(Message(new_message_id(), role, "y" * 900_000, time.time()) for role in roles)
    conv = await state_of(client).store.create_conversation(org.id, messages=messages)

    url = f"/v1/conversations/{conv.id}/shares"
    err = await assert_error(await client.post(url), 400, code="snapshot_too_large", param="message_id")
    assert f"{MAX_SNAPSHOT_CHARS:,}" in err["message"]
    made = await share(client, conv.id, message_id=messages[3].id)  # up to an earlier message: fits
    assert MAX_SNAPSHOT_CHARS // 3 < made["snapshot_chars"] < MAX_SNAPSHOT_CHARS
    updated = await client.post(f"/v1/shares/{made['id']}", json={})  # the whole conversation again
    await assert_error(updated, 400, code="snapshot_too_large", param="message_id")
    assert len((await shared(client, made["token"]))["messages"]) == 4  # the link keeps what it showed


async def big_share(client) -> dict:
    """A link to a snapshot of 5,400,000 characters: more than the socket buffers hold."""
    org = (await state_of(client).keyless_principal()).org
    roles = ["user", "assistant"] * 3
    messages = tuple(Message(new_message_id(), role, "z" * 900_000, time.time()) for role in roles)
    conv = await state_of(client).store.create_conversation(org.id, messages=messages)
    return await share(client, conv.id)


def stalled_reader(client, token: str) -> socket.socket:
    """A reader at 127.0.0.1 that asks for the snapshot and never reads it: its answer stalls in the server."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", client.port))
    sock.sendall(f"GET /v1/shared/{token} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return sock


async def wait_for_sending(readers: ShareReaders, num_snapshots: int, size: int) -> None:
    """Until `num_snapshots` of `size` characters are being sent (UTF-8: a byte or more a character)."""
    for _ in range(200):
        if size * num_snapshots <= readers.num_sending_bytes < size * (num_snapshots + 1):
            return
        await asyncio.sleep(0.02)
    assert size * num_snapshots <= readers.num_sending_bytes < size * (num_snapshots + 1)


async def get_from(client, address: str, path: str, headers=None) -> tuple[int, dict, bytes]:
    """GET `path` from another loopback address (127.0.0.2: another client of the same server)."""
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(f"http://127.0.0.1:{client.port}{path}", headers=headers) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.read()


async def test_readers_that_stop_reading_hold_at_most_the_sending_bound_and_others_get_a_503(make_client):
    client = await make_client()
    made = await big_share(client)
    readers = client.server.app[shares.READERS]
    readers.max_sending_bytes = made["snapshot_chars"] * 3 // 2  # room for one
    sock = stalled_reader(client, made["token"])
    try:
        await wait_for_sending(readers, 1, made["snapshot_chars"])
        status, headers, body = await get_from(client, "127.0.0.2", f"/v1/shared/{made['token']}")
        assert status == 503 and orjson.loads(body)["error"]["code"] == "server_overloaded"
        assert headers["Retry-After"] == "5"
    finally:
        sock.close()
    await wait_for_sending(readers, 0, made["snapshot_chars"])  # the stalled reader gone, its bytes count no more
    resp = await client.get(f"/v1/shared/{made['token']}")
    assert len((await resp.json())["messages"]) == 6


async def test_stalled_readers_at_one_address_hold_only_its_share_and_other_addresses_still_read(make_client):
    client = await make_client()
    made = await big_share(client)
    size = made["snapshot_chars"]
    readers = client.server.app[shares.READERS]
    # Room for two snapshots and a half in all; one address may hold a snapshot and a half of them.
    readers.max_sending_bytes, readers.max_client_sending_bytes = size * 5 // 2, size * 3 // 2
    sock = stalled_reader(client, made["token"])
    try:
        await wait_for_sending(readers, 1, size)
        resp = await client.get(f"/v1/shared/{made['token']}")  # a second one at 127.0.0.1: past its share
        await assert_error(resp, 429, code="rate_limit_exceeded")
        assert resp.headers["Retry-After"] == "5" and readers.sending_bytes_of("127.0.0.1") < size * 3 // 2
        status, _, body = await get_from(client, "127.0.0.2", f"/v1/shared/{made['token']}")
        assert status == 200 and len(orjson.loads(body)["messages"]) == 6  # another address reads
    finally:
        sock.close()
    await wait_for_sending(readers, 0, size)


async def test_an_address_past_its_reads_a_minute_gets_a_429_with_retry_after_and_others_still_read(make_client):
    client = await make_client("sharing.reads_per_minute=3")
    made = await share(client, (await create(client, "Popular question", "Popular answer"))["id"])
    await shared(client, made["token"])
    assert (await client.get(made["path"])).status == 200
    await assert_error(await client.get("/v1/shared/" + "A" * 32), 404, code="share_not_found")  # guesses count
    resp = await client.get(f"/v1/shared/{made['token']}")
    err = await assert_error(resp, 429, code="rate_limit_exceeded")
    assert err["type"] == "rate_limit_exceeded" and "sharing.reads_per_minute" in err["message"]
    assert resp.headers["Retry-After"] == "20"  # one read refills in 60/3 s
    page = await client.get(made["path"])  # the page: its own answer, saying when to come back
    assert page.status == 429 and page.content_type == "text/html" and page.headers["Retry-After"] == "20"
    assert "share.js" in await page.text()
    assert {k: page.headers.get(k) for k in PAGE_HEADERS} == PAGE_HEADERS

    status, _, body = await get_from(client, "127.0.0.2", f"/v1/shared/{made['token']}")
    assert status == 200 and orjson.loads(body)["messages"][0]["content"] == "Popular question"
    assert (await client.get("/v1/shares")).status == 200  # the organisation's own calls: its key's limits


async def test_readers_through_a_trusted_proxy_are_not_held_to_one_addresss_reads(make_client):
    client = await make_client(
        'server.trusted_proxies=["127.0.0.1"]', "server.require_keys=true", "sharing.reads_per_minute=1"
    )
    headers = await org_headers(client, "acme", "enterprise")
    made = await share(client, (await create(client, "Via the proxy", headers=headers))["id"], headers=headers)
    for _ in range(3):  # every reader the proxy serves has its address: none is held to one address's reads
        await shared(client, made["token"])
    assert (await get_from(client, "127.0.0.2", made["path"]))[0] == 200  # not the proxy: one read a minute
    assert (await get_from(client, "127.0.0.2", made["path"]))[0] == 429


async def test_snapshots_count_against_the_storage_cap_and_revoking_gives_the_room_back(make_client):
    client = await make_client("tiers.free.conversation_storage_bytes=1500")
    headers = await org_headers(client, "cheap", "free")
    conv = await create(client, "x" * 600, headers=headers)
    made = await share(client, conv["id"], headers=headers)
    assert made["snapshot_chars"] > 600
    full = await client.post(f"/v1/conversations/{conv['id']}/shares", headers=headers)
    await assert_error(full, 400, code="conversation_quota_exceeded")
    assert (await client.delete(f"/v1/shares/{made['id']}", headers=headers)).status == 200
    assert (await client.post(f"/v1/conversations/{conv['id']}/shares", headers=headers)).status == 201


async def test_links_made_at_once_cannot_pass_the_storage_cap_together(make_client):
    client = await make_client("tiers.free.conversation_storage_bytes=3000", "tiers.free.requests_per_minute=100")
    store = state_of(client).store
    headers = await org_headers(client, "cheap", "free")
    org = await store.get_org("cheap")
    conv = await create(client, "x" * 600, headers=headers)
    made = await share(client, conv["id"], headers=headers)
    # Revoking gives the room back: the next check reads the organisation's size again, while the
    # creates below are all under way.
    assert (await client.delete(f"/v1/shares/{made['id']}", headers=headers)).status == 200
    room = (3000 - 600) // made["snapshot_chars"]

    url = f"/v1/conversations/{conv['id']}/shares"
    statuses = [r.status for r in await asyncio.gather(*(client.post(url, headers=headers) for _ in range(8)))]
    assert sorted(statuses) == [201] * room + [400] * (8 - room)
    assert await store.conversation_bytes(org.id) <= 3000


async def test_creating_updating_and_revoking_count_against_the_request_limit(make_client):
    client = await make_client("tiers.free.requests_per_minute=4")
    headers = await org_headers(client, "cheap", "free")
    conv = await create(client, "Hello", headers=headers)  # 1
    made = await share(client, conv["id"], headers=headers)  # 2
    assert (await client.post(f"/v1/shares/{made['id']}", headers=headers)).status == 200  # 3
    assert (await client.delete(f"/v1/shares/{made['id']}", headers=headers)).status == 200  # 4
    await assert_error(await client.post(f"/v1/conversations/{conv['id']}/shares", headers=headers), 429)
    assert (await client.get("/v1/shares", headers=headers)).status == 200  # reads are not limited here


async def test_with_sharing_off_creating_is_refused_and_links_404_until_it_is_on_again(make_client, tmp_path):
    client = await make_client()
    conv = await create(client, "Shared while on")
    made = await share(client, conv["id"])
    await client.close()
    database = f'store.path="{tmp_path / "chat.db"}"'

    off = await make_client("sharing.enabled=false", database)
    err = await assert_error(await off.post(f"/v1/conversations/{conv['id']}/shares"), 403, code="sharing_disabled")
    assert "sharing.enabled" in err["message"]
    await assert_error(await off.post(f"/v1/shares/{made['id']}"), 403, code="sharing_disabled")
    await assert_error(await off.get(f"/v1/shared/{made['token']}"), 404, code="share_not_found")
    assert (await off.get(made["path"])).status == 404
    listed = await off.get("/v1/shares")
    assert [s["id"] for s in (await listed.json())["data"]] == [made["id"]]
    assert listed.headers["X-Sharing-Enabled"] == "false"  # the web chat hides its Share button
    await off.close()

    on = await make_client(database)
    assert (await shared(on, made["token"]))["messages"][0]["content"] == "Shared while on"
    assert (await on.get("/v1/shares")).headers["X-Sharing-Enabled"] == "true"
