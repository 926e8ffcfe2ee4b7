"""Images through the whole server into the native LLaVA engine (tiny random checkpoint):
image tokens are counted and billed, the next turn with the same image hits the prefix cache,
a different picture of the same size does not, typed "<image>" text makes no image slot, and
too many images are refused before any is decoded. The token-count endpoints count each image
(new or in a previous response's history) as the answer's usage does, and refuse one as it does."""

from __future__ import annotations

import asyncio
import base64

import pytest
from aiohttp import web

from api.app import init
from engine.types import IMAGE_PLACEHOLDER
from media import images
from testing.tiny_llava import build_tiny_llava
from tests.api.helpers import native_settings, state_of
from tests.api.test_files_http import other_org_headers, upload
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


async def test_typed_private_use_text_is_never_an_image_slot_in_an_answer_or_a_count(client):
    """U+E000 (a private-use character, as icon fonts and PDF text hold) typed in a message made an
    image slot: a 400 'image slots for 0 images' for the answer, 16 image tokens in the count."""
    text_only = await ask(client, [{"role": "user", "content": "What is in this picture?"}])
    typed = "What is in this \ue000 picture?"
    answer = await ask(client, [{"role": "user", "content": typed}])
    assert usage(answer)[0] < usage(text_only)[0] + NUM_IMAGE_TOKENS
    assert await count_input(client, input=typed) == usage(answer)[0]
    picture = with_image(typed, png_bytes((40, 30)))
    with_picture = await ask(client, [picture])  # one image, one slot: the typed character stays text
    assert usage(with_picture)[0] < usage(answer)[0] + 2 * NUM_IMAGE_TOKENS


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


# -- token counts: each image is its image tokens, as in the answer's usage ----------------
def input_image(image: bytes | str | None = None, file_id: str | None = None) -> dict:
    """An image part of a Responses input: its bytes (sent as a data: URL), a URL, or an upload's id."""
    if file_id is not None:
        return {"type": "input_image", "file_id": file_id}
    return {"type": "input_image", "image_url": data_url(image) if isinstance(image, bytes) else image}


async def respond(client, **body) -> dict:
    resp = await client.post("/v1/responses", json={"model": "llava", "temperature": 0, "max_output_tokens": 4, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def count_input(client, **body) -> int:
    resp = await client.post("/v1/responses/input_tokens", json={"model": "llava", **body})
    assert resp.status == 200, await resp.text()
    return (await resp.json())["input_tokens"]


async def test_input_tokens_counts_each_image_as_the_image_tokens_a_response_spends(client, monkeypatch):
    decode, decoded = images.decode, []
    monkeypatch.setattr(images, "decode", lambda source, cfg: decoded.append(source) or decode(source, cfg))
    red, green = png_bytes((40, 30), (200, 30, 30)), png_bytes((30, 40), (30, 200, 30))
    form = {"purpose": "vision", "filename": "green.png", "content_type": "image/png"}
    green_id = (await (await upload(client, green, **form)).json())["id"]
    text_only = await count_input(client, input="What is in these pictures?")
    for num_images, images_sent in ((1, [input_image(red)]), (2, [input_image(red), input_image(file_id=green_id)])):
        ask = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is in these pictures?"}]}]}
        ask["input"][0]["content"] += images_sent
        num_decoded = len(decoded)
        counted = await count_input(client, **ask)
        assert len(decoded) == num_decoded  # counted without decoding an image
        assert counted == (await respond(client, **ask))["usage"]["input_tokens"]
        assert counted >= text_only + num_images * NUM_IMAGE_TOKENS and len(decoded) > num_decoded


async def test_input_tokens_counts_a_previous_responses_images_as_the_next_response_does(client):
    picture = png_bytes((40, 30), (30, 30, 200))
    content = [{"type": "input_text", "text": "Describe this picture."}, input_image(picture)]
    first = await respond(client, input=[{"role": "user", "content": content}])
    for store in (True, False):  # stored: the conversation's history; not stored: the history sent inline
        follow = {"input": "And its colors?", "previous_response_id": first["id"], "store": store}
        counted = await count_input(client, **follow)
        assert counted == (await respond(client, **follow))["usage"]["input_tokens"]
        assert counted > first["usage"]["input_tokens"]  # the first prompt's image among them


async def test_count_tokens_counts_each_image_as_the_image_tokens_a_message_spends(client):
    def image_block(image: bytes) -> dict:
        source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
        return {"type": "image", "source": source}

    red, green = png_bytes((40, 30), (200, 30, 30)), png_bytes((30, 40), (30, 200, 30))
    blocks = [{"type": "text", "text": "What is in these pictures?"}, image_block(red), image_block(green)]
    body = {"model": "llava", "messages": [{"role": "user", "content": blocks}]}
    counted = await client.post("/v1/messages/count_tokens", json=body)
    assert counted.status == 200, await counted.text()
    answered = await client.post("/v1/messages", json={**body, "max_tokens": 4, "temperature": 0})
    assert answered.status == 200, await answered.text()
    usage = (await answered.json())["usage"]  # Anthropic's input_tokens leave out those read from cache
    assert (await counted.json())["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] >= 2 * NUM_IMAGE_TOKENS


async def test_input_tokens_refuses_an_image_as_the_response_does(client):
    other = await other_org_headers(client)
    form = {"purpose": "vision", "filename": "theirs.png", "content_type": "image/png"}
    theirs = (await (await upload(client, png_bytes(), headers=other, **form)).json())["id"]
    refused = [
        (400, {"image_url": "data:image/png;base64,@@@not-base64@@@"}),
        (400, {"image_url": "https://example.com/cat.png"}),  # fetching is off (the default): never fetched
        (400, {"image_url": data_url(b"not a picture")}),
        (404, {"file_id": theirs}),  # another organisation's upload
    ]
    for status, ref in refused:
        body = {"model": "llava", "input": [{"role": "user", "content": [{"type": "input_image", **ref}]}]}
        answer = await client.post("/v1/responses", json=body)
        count = await client.post("/v1/responses/input_tokens", json=body)
        assert answer.status == count.status == status, await count.text()
        assert (await count.json())["error"] == (await answer.json())["error"]


async def test_a_remote_image_is_counted_without_fetching_it_and_in_a_history_as_the_response_renders_it(
    aiohttp_client, aiohttp_server, tmp_path, llava_dir
):
    fetched: list[str] = []

    async def serve(request: web.Request) -> web.Response:
        fetched.append(request.path)
        return web.Response(body=png_bytes((40, 30), (90, 90, 30)), content_type="image/png")

    remote = web.Application()
    remote.router.add_get("/{name}", serve)
    server = await aiohttp_server(remote)
    extra = ("images.allow_remote_urls=true", 'images.remote_allow_hosts=["127.0.0.1"]')
    client = await aiohttp_client(init(native_settings(tmp_path, llava_dir, "llava", extra)))
    content = [{"type": "input_text", "text": "Describe this picture."}]
    ask = {"input": [{"role": "user", "content": [*content, input_image(f"http://127.0.0.1:{server.port}/p.png")]}]}
    counted = await count_input(client, **ask)
    assert fetched == []  # the count is fixed per image: nothing to fetch
    first = await respond(client, **ask)
    assert counted == first["usage"]["input_tokens"] and fetched == ["/p.png"]
    follow = {"input": "And its colors?", "previous_response_id": first["id"]}
    counted = await count_input(client, **follow)
    assert counted == (await respond(client, **follow))["usage"]["input_tokens"]  # a remote one: "[image]"
    assert fetched == ["/p.png"]


# -- prepared images: a conversation's earlier images are not decoded again each turn --------
def counting_decodes(monkeypatch) -> list:
    decode, decoded = images.decode, []
    monkeypatch.setattr(images, "decode", lambda source, cfg: decoded.append(source) or decode(source, cfg))
    return decoded


async def two_turns(client) -> list[str]:
    """A conversation whose first turn sends two pictures and whose next two turns send text."""
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    first = with_image("Compare these pictures.", png_bytes((40, 30), (10, 120, 200)))
    first["content"].append({"type": "image_url", "image_url": {"url": data_url(png_bytes((30, 40), (200, 0, 90)))}})
    answers = [(await ask(client, [first], conversation_id=cid))["choices"][0]["message"]["content"]]
    for text in ("Which is brighter?", "And which is taller?"):
        body = await ask(client, [{"role": "user", "content": text}], conversation_id=cid, max_tokens=8)
        answers.append(body["choices"][0]["message"]["content"])
    return answers


async def test_a_conversations_earlier_images_are_prepared_once_and_answer_as_if_decoded_again(
    aiohttp_client, tmp_path, llava_dir, monkeypatch
):
    decoded = counting_decodes(monkeypatch)
    cached = await aiohttp_client(init(native_settings(tmp_path / "a", llava_dir, "llava")))
    answers = await two_turns(cached)
    assert len(decoded) == 2  # the first turn's two pictures; the next turns found them prepared
    prepared = state_of(cached).models["llava"].tokenizer.image_prompter.prepared
    assert len(prepared) == 2 and prepared.num_hits == 4

    decoded.clear()
    extra = ("images.prepared_cache_mb=0",)
    uncached = await aiohttp_client(init(native_settings(tmp_path / "b", llava_dir, "llava", extra)))
    assert await two_turns(uncached) == answers  # greedy: the same answers as decoding each turn
    assert len(decoded) == 6


async def test_an_image_that_fails_to_decode_past_its_header_is_a_400_naming_its_part(client):
    whole = png_bytes((40, 30), (10, 120, 200))
    cut = whole[: len(whole) - 30]  # the header and the start of the pixels: probe passes, decoding fails
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "llava", "messages": [with_image("What is this?", cut)], "max_tokens": 2},
    )
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["code"] == "invalid_image" and error["param"] == "messages[0].content[1]"


async def test_an_image_in_history_trimmed_out_of_the_context_is_not_decoded(
    aiohttp_client, tmp_path, llava_dir, monkeypatch
):
    extra = ("images.prepared_cache_mb=0",)  # nothing kept: each image in the prompt is decoded again
    client = await aiohttp_client(init(native_settings(tmp_path, llava_dir, "llava", extra)))
    decoded = counting_decodes(monkeypatch)
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    await ask(client, [with_image("Describe this picture.", png_bytes((40, 30)))], conversation_id=cid)
    await ask(client, [{"role": "user", "content": "And its colors?"}], conversation_id=cid)
    assert len(decoded) == 2  # the picture is still in the context of the second turn
    long = " ".join(["colour"] * 115)  # alone it fits the 512-token context; with the first turn it does not
    body = await ask(client, [{"role": "user", "content": long}], conversation_id=cid, max_tokens=2)
    assert body["history_messages_dropped"] >= 2 and len(decoded) == 2


async def test_a_vision_model_loaded_on_demand_drops_its_prepared_images_when_it_unloads(
    aiohttp_client, tmp_path, llava_dir
):
    extra = ("models.llava.idle_unload_s=0.2",)
    client = await aiohttp_client(init(native_settings(tmp_path, llava_dir, "llava", extra)))
    handle = state_of(client).models["llava"]
    await ask(client, [with_image("Describe this picture.", png_bytes((40, 30)))])
    prepared = handle.tokenizer.image_prompter.prepared
    assert len(prepared) == 1 and prepared.num_bytes > 0
    for _ in range(250):
        if handle.backend.num_unloads == 1:
            break
        await asyncio.sleep(0.02)
    assert handle.backend.num_unloads == 1 and len(prepared) == 0 and prepared.num_bytes == 0


# -- a stored image that no longer passes: its turns go on with "[image]" in its place ------
async def test_an_imported_image_whose_pixels_are_damaged_is_read_as_text_and_the_conversation_goes_on(client):
    whole = png_bytes((40, 30), (10, 120, 200))
    damaged = whole[: len(whole) - 30]  # its header passes the import's checks; decoding fails
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url(damaged)}}]
    doc = {
        "object": "conversation",
        "title": "old",
        "messages": [
            {"role": "user", "content": "What is this?", "parts": parts, "created_at": 1},
            {"role": "assistant", "content": "A picture.", "model": "llava", "created_at": 2},
        ],
    }
    resp = await client.post("/v1/conversations/import", json=doc)
    assert resp.status == 201, await resp.text()
    cid = (await resp.json())["data"][0]["id"]
    for text in ("And now?", "Still there?"):  # every later turn: it was a 400 naming 'history[1]'
        body = await ask(client, [{"role": "user", "content": text}], conversation_id=cid, max_tokens=2)
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    sent = with_image("What is this?", damaged)  # sent in a request of its own, it is still the caller's 400
    resp = await client.post("/v1/chat/completions", json={"model": "llava", "messages": [sent], "max_tokens": 2})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "messages[0].content[1]"


async def test_a_stored_image_past_a_lowered_limit_is_read_as_text_and_the_turn_goes_on(
    aiohttp_client, tmp_path, llava_dir, monkeypatch
):
    first = await aiohttp_client(init(native_settings(tmp_path, llava_dir, "llava")))
    cid = (await (await first.post("/v1/conversations", json={})).json())["id"]
    await ask(first, [with_image("Describe this picture.", png_bytes((40, 30)))], conversation_id=cid)
    await first.close()
    lowered = ("images.max_image_pixels=100",)  # the stored 40x30 picture is now past it
    client = await aiohttp_client(init(native_settings(tmp_path, llava_dir, "llava", lowered)))
    decoded = counting_decodes(monkeypatch)
    body = await ask(client, [{"role": "user", "content": "And its colors?"}], conversation_id=cid, max_tokens=2)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")  # it was a 400 naming 'history[1]'
    assert decoded == [] and len(state_of(client).models["llava"].tokenizer.image_prompter.prepared) == 0
    assert len((await (await client.get(f"/v1/conversations/{cid}")).json())["messages"]) == 4
