"""The Files API over HTTP: OpenAI's shapes, limits checked while the upload streams, quotas,
isolation between organisations, retention and deletion."""

from __future__ import annotations

import aiohttp
import pytest

from api.files import BLOBS, purge_once
from tests.api.helpers import assert_error, org_headers, state_of


def form(
    content: bytes, *, filename: str = "notes.txt", purpose: str | None = "user_data", content_type: str = "text/plain"
) -> aiohttp.FormData:
    data = aiohttp.FormData()
    if purpose is not None:
        data.add_field("purpose", purpose)
    data.add_field("file", content, filename=filename, content_type=content_type)
    return data


async def upload(client, content: bytes = b"hello file", headers=None, **kw):
    return await client.post("/v1/files", data=form(content, **kw), headers=headers or {})


async def other_org_headers(client, tier: str = "enterprise") -> dict:
    return await org_headers(client, "other", tier)


def files_dir(client):
    return client.server.app[BLOBS].root


async def test_upload_returns_openai_file_object_and_content_round_trips(make_client):
    client = await make_client()
    resp = await upload(client, b"line one\nline two\n")
    assert resp.status == 200, await resp.text()
    obj = await resp.json()
    assert obj["object"] == "file" and obj["id"].startswith("file-")
    assert obj["bytes"] == 18 and obj["filename"] == "notes.txt" and obj["purpose"] == "user_data"
    assert obj["status"] == "processed" and isinstance(obj["created_at"], int)
    assert obj["expires_at"] == obj["created_at"] + 30 * 86400  # the tier's file_retention_days
    got = await client.get(f"/v1/files/{obj['id']}")
    assert await got.json() == obj
    content = await client.get(f"/v1/files/{obj['id']}/content")
    assert content.status == 200 and await content.read() == b"line one\nline two\n"
    assert content.headers["Content-Type"].startswith("text/plain")
    assert (files_dir(client) / obj["id"]).read_bytes() == b"line one\nline two\n"


async def test_list_pages_newest_first_and_filters_by_purpose(make_client):
    client = await make_client()
    ids = [
        (await (await upload(client, f"f{i}".encode(), purpose=p)).json())["id"]
        for i, p in enumerate(["user_data", "vision", "user_data"])
    ]
    body = await (await client.get("/v1/files")).json()
    assert body["object"] == "list" and [f["id"] for f in body["data"]] == ids[::-1]
    page = await (await client.get("/v1/files", params={"limit": "1", "order": "asc"})).json()
    assert [f["id"] for f in page["data"]] == ids[:1] and page["has_more"] is True
    after = await (await client.get("/v1/files", params={"order": "asc", "after": ids[0]})).json()
    assert [f["id"] for f in after["data"]] == ids[1:]
    vision = await (await client.get("/v1/files", params={"purpose": "vision"})).json()
    assert [f["id"] for f in vision["data"]] == [ids[1]]
    await assert_error(await client.get("/v1/files", params={"limit": "0"}), 400, param="limit")
    await assert_error(await client.get("/v1/files", params={"order": "up"}), 400, param="order")


async def test_html_is_never_served_as_a_page(make_client):
    client = await make_client()
    obj = await (await upload(client, b"<script>alert(1)</script>", filename="x.html", content_type="text/html")).json()
    resp = await client.get(f"/v1/files/{obj['id']}/content")
    assert resp.headers["Content-Type"] == "application/octet-stream"
    assert resp.headers["Content-Disposition"].startswith("attachment")
    assert "sandbox" in resp.headers["Content-Security-Policy"]


async def test_upload_over_the_size_limit_is_refused_while_streaming_and_leaves_nothing(make_client):
    client = await make_client("files.max_file_bytes=100000")

    async def chunks():  # chunked transfer: no Content-Length, so only the streaming check can catch it
        for _ in range(40):
            yield b"x" * 16384

    data = aiohttp.FormData()
    data.add_field("purpose", "user_data")
    data.add_field("file", chunks(), filename="big.bin", content_type="application/octet-stream")
    resp = await client.post("/v1/files", data=data)
    err = await assert_error(resp, 413, code="file_too_large", param="file")
    assert "100000" in err["message"]
    assert not [p for p in files_dir(client).rglob("*") if p.is_file()]
    assert (await (await client.get("/v1/files")).json())["data"] == []


async def test_declared_length_over_the_limit_is_refused_before_reading(make_client):
    client = await make_client("files.max_file_bytes=1000")
    await assert_error(await upload(client, b"y" * 50_000), 413, code="file_too_large")


async def test_quota_in_files_and_bytes_per_tier(make_client):
    client = await make_client("tiers.enterprise.max_files=2", "tiers.enterprise.file_storage_bytes=1000")
    assert (await upload(client, b"a" * 400)).status == 200
    err = await assert_error(await upload(client, b"b" * 700), 400, code="file_quota_exceeded")
    assert "1000" in err["message"]
    assert (await upload(client, b"c" * 500)).status == 200
    err = await assert_error(await upload(client, b"d"), 400, code="file_quota_exceeded")
    assert "2 files" in err["message"]
    assert len((await (await client.get("/v1/files")).json())["data"]) == 2
    assert len([p for p in files_dir(client).iterdir() if p.is_file()]) == 2


async def test_another_organisations_file_is_not_found_and_not_deletable(make_client):
    client = await make_client()
    obj = await (await upload(client, b"secret")).json()
    other = await other_org_headers(client)
    for method, path in [("GET", ""), ("GET", "/content"), ("DELETE", "")]:
        resp = await client.request(method, f"/v1/files/{obj['id']}{path}", headers=other)
        await assert_error(resp, 404, param="file_id")
    assert (await (await client.get("/v1/files", headers=other)).json())["data"] == []
    assert (await client.get(f"/v1/files/{obj['id']}")).status == 200


async def test_delete_removes_row_and_bytes_then_404(make_client):
    client = await make_client()
    obj = await (await upload(client, b"bye")).json()
    resp = await client.delete(f"/v1/files/{obj['id']}")
    assert await resp.json() == {"id": obj["id"], "object": "file", "deleted": True}
    assert not (files_dir(client) / obj["id"]).exists()
    await assert_error(await client.get(f"/v1/files/{obj['id']}"), 404)
    await assert_error(await client.delete(f"/v1/files/{obj['id']}"), 404)


async def test_expired_files_are_hidden_then_purged_with_their_bytes(make_client):
    client = await make_client("tiers.enterprise.file_retention_days=1")
    obj = await (await upload(client, b"old")).json()
    store = state_of(client).store
    assert await purge_once(store, client.server.app[BLOBS], now=obj["created_at"] + 3600) == 0
    assert (files_dir(client) / obj["id"]).exists()
    assert await purge_once(store, client.server.app[BLOBS], now=obj["created_at"] + 2 * 86400) == 1
    assert not (files_dir(client) / obj["id"]).exists()
    await assert_error(await client.get(f"/v1/files/{obj['id']}"), 404)


async def test_bad_uploads_name_the_field(make_client):
    client = await make_client()
    await assert_error(await upload(client, purpose="homework"), 400, param="purpose")
    await assert_error(await upload(client, purpose=None), 400, param="purpose")
    await assert_error(await client.post("/v1/files", json={"purpose": "user_data"}), 400, code="invalid_content_type")
    only_purpose = aiohttp.FormData()
    only_purpose.add_field("purpose", "user_data")
    only_purpose.add_field("note", "x", filename="n.txt")
    await assert_error(await client.post("/v1/files", data=only_purpose), 400, param="note")
    await assert_error(await client.get("/v1/files/../../etc/passwd"), 404)
    await assert_error(await client.get("/v1/files/file-nothere"), 404, param="file_id")
    for content_type in ("multipart/form-data", "multipart/form-data; boundary=zz"):  # none, or not in the body
        resp = await client.post("/v1/files", data=b"garbage", headers={"Content-Type": content_type})
        await assert_error(resp, 400, code="invalid_multipart")
    control = (  # a control character in a part's header: a 500 with a logged trace
        b'--zz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
        b'--zz\r\nContent-Disposition: form-data; name="file"; filename="a\x1b[31mb\nc.txt"\r\n'
        b"Content-Type: text/plain\r\n\r\nhello\r\n--zz--\r\n"
    )
    resp = await client.post("/v1/files", data=control, headers={"Content-Type": "multipart/form-data; boundary=zz"})
    assert resp.status == 400, await resp.text()


async def test_magic_bytes_decide_the_media_type(make_client):
    client = await make_client()
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
    obj = await (await upload(client, png, filename="pic.txt", content_type="text/plain")).json()
    resp = await client.get(f"/v1/files/{obj['id']}/content")
    assert resp.headers["Content-Type"] == "image/png"


async def test_the_official_openai_sdk_uploads_lists_reads_and_deletes(make_client, tmp_path):
    import openai

    client = await make_client()
    key = (await other_org_headers(client))["Authorization"].removeprefix("Bearer ")
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)
    path = tmp_path / "report.txt"
    path.write_bytes(b"Sales grew.")
    with path.open("rb") as fh:
        created = await sdk.files.create(file=fh, purpose="user_data")
    assert created.filename == "report.txt" and created.bytes == 11 and created.purpose == "user_data"
    assert [f.id async for f in sdk.files.list()] == [created.id]
    assert (await sdk.files.retrieve(created.id)).id == created.id
    assert (await sdk.files.content(created.id)).content == b"Sales grew."
    answer = await sdk.chat.completions.create(
        model="echo",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Read this."}, {"type": "file", "file": {"file_id": created.id}}],
            }
        ],
    )
    assert "Sales grew." in answer.choices[0].message.content
    assert (await sdk.files.delete(created.id)).deleted is True
    with pytest.raises(openai.NotFoundError):
        await sdk.files.retrieve(created.id)


async def test_a_large_upload_streams_to_disk_without_being_held_in_memory(make_client):
    import tracemalloc

    client = await make_client("files.max_file_bytes=67108864")
    chunk = b"z" * 1_048_576

    async def body():
        for _ in range(24):
            yield chunk

    data = aiohttp.FormData()
    data.add_field("purpose", "user_data")
    data.add_field("file", body(), filename="big.bin", content_type="application/octet-stream")
    tracemalloc.start()
    try:
        resp = await client.post("/v1/files", data=data)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["bytes"] == 24 * 1_048_576
    assert peak_bytes < 8 * 1_048_576, f"peak {peak_bytes} bytes for a 24 MiB upload"
