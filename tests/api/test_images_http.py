"""Images in chat messages over HTTP: every refusal (bad data URL, undecodable bytes, too large,
too many pixels, decompression bomb, remote URL when off or host not allowed, too many images,
another organisation's image) and a model without vision named in its 400, the token counts' too."""

from __future__ import annotations

import base64
import io

from aiohttp import web
from PIL import Image

from api.state import STATE
from tests.api.helpers import assert_error
from tests.api.test_files_http import other_org_headers, upload


def png_bytes(size=(8, 6), color=(200, 30, 30), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_message(image_url: dict, text: str = "What is in this picture?") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": image_url}]}
    ]


async def chat(client, messages, headers=None):
    return await client.post(
        "/v1/chat/completions", json={"model": "echo", "messages": messages}, headers=headers or {}
    )


async def test_a_valid_image_to_a_model_without_vision_is_a_400_naming_the_model(make_client):
    client = await make_client()
    err = await assert_error(
        await chat(client, image_message({"url": data_url(png_bytes())})),
        400,
        code="image_input_not_supported",
        param="messages[0].content[1]",
    )
    assert "'echo'" in err["message"]
    listed = (await (await client.get("/v1/models/echo")).json())["vision"]
    assert listed is False  # /v1/models says so, and the web UI warns at attach time


async def test_a_large_inline_image_is_not_taken_for_millions_of_prompt_tokens(make_client):
    """Admission guesses a prompt's tokens from its body's bytes before parsing it: a photo sent
    inline (as Open WebUI sends images) counted as bytes / 3 tokens and got 429, past any
    bucket, before the model could even say it takes no images."""
    import os

    client = await make_client(
        "server.max_body_bytes=2000000", "tiers.free.tokens_per_minute=20000", 'tiers.free.models=["echo", "echo2"]'
    )
    store = client.app[STATE].store
    await store.create_org("cheap", "free")
    _key, secret = await store.create_key("cheap")
    noise = Image.frombytes("RGB", (400, 400), os.urandom(400 * 400 * 3))
    buf = io.BytesIO()
    noise.save(buf, format="PNG")
    assert len(buf.getvalue()) > 400_000  # ~160k "tokens" by bytes, 8 times the bucket
    await assert_error(
        await chat(client, image_message({"url": data_url(buf.getvalue())}), {"Authorization": f"Bearer {secret}"}),
        400,
        code="image_input_not_supported",
    )


async def test_bad_data_urls_are_refused(make_client):
    client = await make_client()
    for url in ["data:image/png;base64,@@@not-base64@@@", "data:text/plain;base64,aGk=", "data:image/png,rawbytes"]:
        await assert_error(await chat(client, image_message({"url": url})), 400, code="invalid_image_url")
    await assert_error(
        await chat(client, image_message({"url": "ftp://example.com/a.png"})), 400, code="invalid_image_url"
    )
    undecodable = data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    await assert_error(await chat(client, image_message({"url": undecodable})), 400, code="invalid_image")
    await assert_error(await chat(client, image_message({})), 400, param="messages[0].content[1].image_url")
    await assert_error(
        await chat(client, image_message({"url": data_url(png_bytes()), "detail": "max"})),
        400,
        param="messages[0].content[1].image_url.detail",
    )


async def test_too_many_pixels_is_refused_before_decoding(make_client):
    client = await make_client("images.max_image_pixels=1000")
    err = await assert_error(
        await chat(client, image_message({"url": data_url(png_bytes((40, 30)))})), 400, code="image_too_many_pixels"
    )
    assert "40x30 = 1200 pixels" in err["message"] and "1000" in err["message"]


async def test_decompression_bomb_is_refused(make_client):
    client = await make_client("server.max_body_bytes=200000")
    bomb = png_bytes((8000, 8000), 0, mode="1")  # 64 Mpixel in a few kB
    assert len(bomb) < 100_000
    await assert_error(await chat(client, image_message({"url": data_url(bomb)})), 400, code="image_too_many_pixels")


async def test_image_larger_than_the_byte_limit_is_refused(make_client):
    client = await make_client("images.max_image_bytes=100")
    await assert_error(
        await chat(client, image_message({"url": data_url(png_bytes((64, 64), (1, 2, 3)) * 2)})),
        400,
        code="image_too_large",
    )


async def test_remote_urls_are_refused_when_off_and_outside_the_allow_list(make_client):
    client = await make_client()
    err = await assert_error(
        await chat(client, image_message({"url": "http://169.254.169.254/latest/x.png"})),
        400,
        code="image_url_not_allowed",
    )
    assert "allow_remote_urls" in err["message"]
    client = await make_client("images.allow_remote_urls=true", 'images.remote_allow_hosts=["images.example.com"]')
    err = await assert_error(
        await chat(client, image_message({"url": "http://127.0.0.1:9/x.png"})), 400, code="image_url_not_allowed"
    )
    assert "'127.0.0.1'" in err["message"]


async def test_an_allowed_host_is_fetched_without_following_redirects(make_client, aiohttp_server):
    image = png_bytes()

    async def serve(request: web.Request) -> web.StreamResponse:
        if request.path == "/moved.png":
            raise web.HTTPFound("http://169.254.169.254/secret")
        return web.Response(body=image, content_type="image/png")

    remote = web.Application()
    remote.router.add_get("/{name}", serve)
    server = await aiohttp_server(remote)
    client = await make_client("images.allow_remote_urls=true", 'images.remote_allow_hosts=["127.0.0.1"]')
    base = f"http://127.0.0.1:{server.port}"
    # Fetched and decoded: the refusal is now the model's, not the image's.
    await assert_error(
        await chat(client, image_message({"url": f"{base}/ok.png"})), 400, code="image_input_not_supported"
    )
    err = await assert_error(
        await chat(client, image_message({"url": f"{base}/moved.png"})), 400, code="image_fetch_failed"
    )
    assert "302" in err["message"]


async def test_uploaded_images_by_file_id_and_their_isolation(make_client):
    client = await make_client("images.max_images_per_request=2")
    file_id = (
        await (await upload(client, png_bytes(), filename="p.png", content_type="image/png", purpose="vision")).json()
    )["id"]
    await assert_error(await chat(client, image_message({"file_id": file_id})), 400, code="image_input_not_supported")
    as_file = [{"role": "user", "content": [{"type": "file", "file": {"file_id": file_id}}]}]
    await assert_error(await chat(client, as_file), 400, code="image_input_not_supported")
    other = await other_org_headers(client)
    await assert_error(await chat(client, image_message({"file_id": file_id}), headers=other), 404)
    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"file_id": file_id}}] * 3}]
    await assert_error(await chat(client, three), 400, code="too_many_images")


async def test_token_counts_refuse_images_for_a_model_without_vision_as_the_answer_does(make_client):
    client = await make_client()
    image = png_bytes()
    responses = {
        "model": "echo",
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)}]}],
    }
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    messages = {"model": "echo", "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}]}
    for answer_path, count_path, body in (
        ("/v1/responses", "/v1/responses/input_tokens", responses),
        ("/v1/messages", "/v1/messages/count_tokens", {**messages, "max_tokens": 4}),
    ):
        answer = await client.post(answer_path, json=body)
        count = await client.post(count_path, json=body)
        assert answer.status == count.status == 400, await count.text()
        answer_error, count_error = (await answer.json())["error"], (await count.json())["error"]
        assert count_error == answer_error and "'echo' does not accept images" in count_error["message"]
