"""Images through the whole server into the native LLaVA engine (tiny random checkpoint):
image tokens are counted and billed, the next turn with the same image hits the prefix cache,
a different picture of the same size does not, typed "<image>" text makes no image slot, and
too many images are refused before any is decoded."""

from __future__ import annotations

import pytest

from api.app import init
from engine.types import IMAGE_PLACEHOLDER
from media import images
from testing.tiny_llava import build_tiny_llava
from tests.api.helpers import native_settings, state_of
from tests.api.test_images_http import data_url, png_bytes

NUM_IMAGE_TOKENS = 16


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava-http") / "tiny-llava")


@pytest.fixture
async def client(aiohttp_client, tmp_path, llava_dir):
    settings = native_settings(tmp_path, llava_dir, "llava")
    return await aiohttp_client(init(settings), server_kwargs={"handler_cancellation": True})


def with_image(text: str, image: bytes) -> dict:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}],
    }


async def ask(client, messages, **extra) -> dict:
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "llava", "messages": messages, "temperature": 0, "max_tokens": 6, **extra},
    )
    assert resp.status == 200, await resp.text()
    return await resp.json()


def usage(body: dict) -> tuple[int, int]:
    return body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_image_tokens_are_counted_in_usage(client):
    assert (await (await client.get("/v1/models/llava")).json())["vision"] is True
    text_only = await ask(client, [{"role": "user", "content": "What is in this picture?"}])
    image = await ask(client, [with_image("What is in this picture?", png_bytes((40, 30)))])
    assert usage(image)[0] >= usage(text_only)[0] + NUM_IMAGE_TOKENS
    typed = await ask(client, [{"role": "user", "content": "What is in this <image> picture?"}])
    assert usage(typed)[0] < usage(text_only)[0] + NUM_IMAGE_TOKENS  # typed text is never an image slot


async def test_same_image_next_turn_hits_and_a_different_image_does_not(client):
    picture, other = png_bytes((40, 30), (200, 30, 30)), png_bytes((40, 30), (30, 200, 30))
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    first = await ask(client, [with_image("Describe this picture in detail please.", picture)], conversation_id=cid)
    second = await ask(client, [{"role": "user", "content": "And its colors?"}], conversation_id=cid)
    assert usage(second)[1] >= usage(first)[0] - 16  # every full block of the first prompt, the image's included
    stored = await (await client.get(f"/v1/conversations/{cid}")).json()
    assert stored["messages"][0]["parts"][1]["type"] == "image_url"
    fresh = await ask(client, [with_image("Describe this picture in detail please.", other)])
    tokenizer = state_of(client).models["llava"].tokenizer
    ids = tokenizer.encode_chat(
        [{"role": "user", "content": f"Describe this picture in detail please.\n\n{IMAGE_PLACEHOLDER}"}]
    )
    image_start = ids.index(tokenizer.image_prompter.image_token_id)
    assert 0 < usage(fresh)[1] <= image_start  # the blocks before the image only: nothing from a different picture
    again = await ask(client, [with_image("Describe this picture in detail please.", other)])
    assert usage(again)[1] >= usage(again)[0] - 16  # the same picture again: all its full blocks hit


async def test_too_many_images_are_refused_before_any_is_decoded(client, monkeypatch):
    decoded: list = []
    monkeypatch.setattr(images, "decode", lambda source, cfg: decoded.append(source))
    nine = [{"type": "image_url", "image_url": {"url": data_url(png_bytes((40, 30)))}}] * 9  # the limit is 8
    resp = await client.post(
        "/v1/chat/completions", json={"model": "llava", "messages": [{"role": "user", "content": nine}]}
    )
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "too_many_images"
    assert decoded == []
