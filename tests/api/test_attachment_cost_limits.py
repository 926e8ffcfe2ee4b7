"""Attachments whose cost is bounded before the costly work: file parts are counted before any is
looked up; a file or image named many times in a request is read, checked and counted once; a
document certainly longer than the room for documents is refused ("at least N tokens") or cut
from a prefix without being tokenized whole, while one that may fit is counted exactly; an image
whose headers are built to loop the reader is a 400 naming why. Spies count what reached our
functions and the tokenizer."""

from __future__ import annotations

import base64
import random
import re

import pytest
from PIL import Image

import engine.tokenizer as tokenizer_module
from api import attachment_parts, attachments
from api.app import init
from api.files import TEXTS
from engine.tokenizer import ChatTemplates, Tokenizer
from media import extraction, images
from testing.tiny_llava import build_tiny_llava
from testing.tiny_model import train_tokenizer
from tests.api.helpers import assert_error, native_settings, state_of
from tests.api.test_files_http import upload
from tests.api.test_images_http import data_url, png_bytes
from tests.media.test_image_probe_bounds import jpeg_with_markers

NON_LATIN = [chr(c) for c in range(0x800, 0x2FFF)]


def text_of(num_chars: int, seed: int = 0) -> str:
    return "".join(random.Random(seed).choices(NON_LATIN, k=num_chars))


@pytest.fixture
def tokenized(monkeypatch) -> list[int]:
    """The length of every text the tokenizer encoded (each test clears it once its app has started)."""
    calls: list[int] = []
    real = tokenizer_module._encode

    def spy(tok, text: str, *, add_special_tokens: bool) -> list[int]:
        calls.append(len(text))
        return real(tok, text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tokenizer_module, "_encode", spy)
    return calls


def spy_on(monkeypatch, owner, name: str) -> list:
    """Record each call's arguments to an async function of `owner` (a module or object), still calling it."""
    calls: list = []
    real = getattr(owner, name)

    async def spy(*args):
        calls.append(args)
        return await real(*args)

    monkeypatch.setattr(owner, name, spy)
    return calls


async def upload_text(client, text: str, filename: str) -> str:
    return (await (await upload(client, text.encode(), filename=filename)).json())["id"]


def with_files(*file_ids: str, text: str = "Summarize:") -> list[dict]:
    parts = [{"type": "file", "file": {"file_id": f}} for f in file_ids]
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def with_images(*image_urls: dict) -> list[dict]:
    parts = [{"type": "image_url", "image_url": u} for u in image_urls]
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


async def chat(client, messages, **extra):
    body = {"model": "echo", "messages": messages, "max_tokens": 64, **extra}
    return await client.post("/v1/chat/completions", json=body)


# -- file parts ---------------------------------------------------------------------------------
async def test_more_file_parts_than_the_limit_are_refused_before_any_file_is_looked_up(make_client, monkeypatch):
    client = await make_client("files.max_files_per_request=2")
    file_id = await upload_text(client, "A short note.", "note.txt")
    looked_up = spy_on(monkeypatch, attachment_parts, "_owned")
    err = await assert_error(
        await chat(client, with_files(file_id, file_id, file_id)), 400, code="too_many_files", param="messages"
    )
    assert "3 file parts; the limit is 2" in err["message"]
    assert looked_up == []
    assert (await chat(client, with_files(file_id, file_id))).status == 200


async def test_a_file_attached_many_times_is_read_once_and_rendered_each_time(make_client, monkeypatch):
    client = await make_client()
    file_id = await upload_text(client, "The secret word is pineapple.", "note.txt")
    looked_up = spy_on(monkeypatch, state_of(client).store, "get_file")
    read = spy_on(monkeypatch, extraction, "cached_extract")
    resp = await chat(client, with_files(*[file_id] * 3), max_tokens=16)
    assert resp.status == 200, await resp.text()
    assert len(read) == 1 and len(looked_up) == 1
    once = await (await chat(client, with_files(file_id), max_tokens=16)).json()
    num_text_tokens = len(state_of(client).models["echo"].tokenizer.encode("The secret word is pineapple."))
    num_added = (await resp.json())["usage"]["prompt_tokens"] - once["usage"]["prompt_tokens"]
    assert (
        num_added > 2 * num_text_tokens
    )  # each copy is in the prompt, with its header and footer  # the later lookups are answered from what was read


async def test_a_conversations_files_are_looked_up_in_one_read_a_turn_and_their_text_kept_in_memory(
    make_client, monkeypatch
):
    client = await make_client()
    notes = [f"Note {n}: the code is {n}{n}{n}." for n in range(3)]
    file_ids = [await upload_text(client, note, f"note{n}.txt") for n, note in enumerate(notes)]
    conv = (await (await client.post("/v1/conversations", json={})).json())["id"]
    assert (await chat(client, with_files(*file_ids), conversation_id=conv)).status == 200
    looked_up = spy_on(monkeypatch, state_of(client).store, "get_file")
    read = spy_on(monkeypatch, extraction, "cached_extract")
    num_note_tokens = sum(len(state_of(client).models["echo"].tokenizer.encode(note)) for note in notes)
    for question in ("And the first code?", "And the last?"):
        resp = await chat(client, [{"role": "user", "content": question}], conversation_id=conv)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["usage"]["prompt_tokens"] > num_note_tokens  # the files are in the history
    assert looked_up == []  # one read of the store for all of the history's files (Store.get_files)
    assert read == []  # neither extracted nor read from the cache beside the upload again: kept in memory


async def test_a_deleted_files_text_leaves_memory_and_the_history_says_it_is_gone(make_client):
    client = await make_client()
    file_id = await upload_text(client, "The meeting is at noon.", "meeting.txt")
    conv = (await (await client.post("/v1/conversations", json={})).json())["id"]
    assert (await chat(client, with_files(file_id), conversation_id=conv)).status == 200
    texts = client.server.app[TEXTS]
    assert len(texts) == 1 and texts.num_chars == len("The meeting is at noon.")
    assert (await client.delete(f"/v1/files/{file_id}")).status == 200
    assert len(texts) == 0 and texts.num_chars == 0
    resp = await chat(client, [{"role": "user", "content": "When?"}], conversation_id=conv)
    assert resp.status == 200, await resp.text()
    assert len(texts) == 0


async def test_files_of_earlier_turns_do_not_count_toward_max_files_per_request(make_client):
    client = await make_client("files.max_files_per_request=2")
    file_ids = [await upload_text(client, f"Note {n}.", f"note{n}.txt") for n in range(5)]
    conv = (await (await client.post("/v1/conversations", json={})).json())["id"]
    assert (await chat(client, with_files(*file_ids[:2]), conversation_id=conv)).status == 200
    assert (await chat(client, with_files(*file_ids[2:4]), conversation_id=conv)).status == 200
    err = await assert_error(
        await chat(client, with_files(*file_ids[:3]), conversation_id=conv), 400, code="too_many_files"
    )
    assert "3 file parts; the limit is 2 (files.max_files_per_request" in err["message"]


def input_files(*file_ids: str) -> list[dict]:
    content = [{"type": "input_text", "text": "Read: "}, *({"type": "input_file", "file_id": f} for f in file_ids)]
    return [{"role": "user", "content": content}]


async def test_previous_responses_files_do_not_count_toward_the_limit_whether_stored_or_not(make_client):
    client = await make_client("files.max_files_per_request=2")
    file_ids = [await upload_text(client, f"Note {n}.", f"note{n}.txt") for n in range(5)]
    body = {"model": "echo", "max_output_tokens": 16}
    first = await client.post("/v1/responses", json={**body, "input": input_files(*file_ids[:2])})
    assert first.status == 200, await first.text()
    previous = (await first.json())["id"]
    for store in (True, False):
        more = {**body, "input": input_files(file_ids[4]), "previous_response_id": previous, "store": store}
        resp = await client.post("/v1/responses", json=more)
        assert resp.status == 200, (store, await resp.text())
    too_many = {**body, "input": input_files(*file_ids[2:5]), "previous_response_id": previous, "store": False}
    await assert_error(await client.post("/v1/responses", json=too_many), 400, code="too_many_files")


async def test_a_document_far_past_the_context_attached_ten_times_is_bounded_once_never_tokenized(
    make_client, monkeypatch, tokenized
):
    client = await make_client()  # the context: 400 tokens
    text = text_of(40_000)
    file_id = await upload_text(client, text, "big.txt")
    counted: list = []
    real_count = attachments._count
    monkeypatch.setattr(attachments, "_count", lambda *args: counted.append(args) or real_count(*args))
    tokenized.clear()
    err = await assert_error(await chat(client, with_files(*[file_id] * 10)), 400, code="context_length_exceeded")
    assert len(counted) == 1
    assert max(tokenized) < len(text) // 10  # the rest of the prompt only
    match = re.search(r"big\.txt is at least (\d+) tokens", err["message"])
    assert match is not None and err["message"].count("big.txt is") == 1
    exact = len(state_of(client).models["echo"].tokenizer.encode(text))
    assert 400 < int(match.group(1)) <= exact  # a true lower bound, past the context


async def test_truncation_auto_cuts_a_document_far_past_the_context_from_a_prefix(make_client, tokenized):
    client = await make_client()
    text = text_of(40_000)
    file_id = await upload_text(client, text, "big.txt")
    tokenized.clear()
    resp = await chat(client, with_files(file_id), truncation="auto", max_tokens=32)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    (cut,) = body["truncated_files"]
    assert cut["num_tokens_is_lower_bound"] is True
    assert 0 < cut["num_tokens_kept"] < cut["num_tokens"]
    assert body["usage"]["prompt_tokens"] + 32 <= 400
    assert max(tokenized) < len(text) // 10
    exact = len(state_of(client).models["echo"].tokenizer.encode(text))
    assert cut["num_tokens"] <= exact


async def test_documents_that_may_fit_the_room_are_counted_exactly(make_client):
    client = await make_client()
    tok = state_of(client).models["echo"].tokenizer
    words = [f"word{i}" for i in range(400)]
    text = " ".join(words[: next(k for k in range(1, 400) if len(tok.encode(" ".join(words[:k]))) >= 200)])
    first, second = await upload_text(client, text, "a.txt"), await upload_text(client, text + " end", "b.txt")
    err = await assert_error(await chat(client, with_files(first, second)), 400, code="context_length_exceeded")
    assert f"a.txt is {len(tok.encode(text))} tokens" in err["message"]
    assert f"b.txt is {len(tok.encode(text + ' end'))} tokens" in err["message"]


def test_a_count_is_exact_for_a_tokenizer_that_adds_a_bos_and_bounded_past_the_room(tokenized):
    hf = train_tokenizer(300)
    hf.add_special_tokens(["<bos>"])
    from tokenizers import processors

    hf.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", hf.token_to_id("<bos>"))]
    )
    tok = Tokenizer(hf, ChatTemplates(None), {}, ())
    assert tok.encode_prompt("hello")[0] == hf.token_to_id("<bos>")
    short, long = "hello there, " * 20, text_of(20_000)
    assert attachments._count(tok, short, 1000) == attachments.DocTokens(len(tok.encode(short)))
    tokenized.clear()
    bounded = attachments._count(tok, long, 1000)
    assert bounded.is_lower_bound and 1000 < bounded.num_tokens <= len(tok.encode(long))
    assert tokenized == [len(long)]  # only the check above tokenized it


# -- images -------------------------------------------------------------------------------------
async def test_an_image_named_eight_times_is_read_and_checked_once(make_client, monkeypatch):
    client = await make_client()
    probed: list = []
    real = images.probe
    monkeypatch.setattr(images, "probe", lambda source, cfg: probed.append(source) or real(source, cfg))
    picture = png_bytes((32, 32))
    resp = await upload(client, picture, filename="p.png", content_type="image/png", purpose="vision")
    file_id = (await resp.json())["id"]
    await assert_error(
        await chat(client, with_images(*[{"file_id": file_id}] * 8)), 400, code="image_input_not_supported"
    )
    assert len(probed) == 1
    inline = {"url": data_url(picture)}
    await assert_error(await chat(client, with_images(*[inline] * 8)), 400, code="image_input_not_supported")
    assert len(probed) == 2


async def test_an_image_whose_headers_loop_the_reader_is_a_400_naming_why(make_client, monkeypatch):
    client = await make_client("server.max_body_bytes=200000")
    opened: list = []
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: opened.append(args))
    bomb = jpeg_with_markers(5000)
    resp = await upload(client, bomb, filename="x.jpeg", content_type="image/jpeg", purpose="vision")
    file_id = (await resp.json())["id"]
    err = await assert_error(
        await chat(client, with_images(*[{"file_id": file_id}] * 8)),
        400,
        code="invalid_image",
        param="messages[0].content[1]",
    )
    assert "more than 512 markers" in err["message"]
    source = {"type": "base64", "media_type": "image/jpeg", "data": base64.b64encode(bomb).decode()}
    body = {
        "model": "echo",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
    }
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 400, await resp.text()
    assert "more than 512 markers" in (await resp.json())["error"]["message"]
    assert opened == []


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava-twice") / "tiny-llava")


async def test_a_vision_model_decodes_an_image_named_twice_once_and_reads_it_twice(
    aiohttp_client, tmp_path, llava_dir, monkeypatch
):
    extra = ("images.prepared_cache_mb=0",)  # else the second request finds it prepared by the first
    client = await aiohttp_client(init(native_settings(tmp_path, llava_dir, "llava", extra)))
    decoded: list = []
    real = images.decode
    monkeypatch.setattr(images, "decode", lambda source, cfg: decoded.append(source) or real(source, cfg))
    inline = {"url": data_url(png_bytes((40, 30)))}
    prompt_tokens = []
    for messages in (with_images(inline), with_images(inline, inline)):
        body = {"model": "llava", "messages": messages, "temperature": 0, "max_tokens": 4}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        prompt_tokens.append((await resp.json())["usage"]["prompt_tokens"])
    assert len(decoded) == 2  # once per request
    assert prompt_tokens[1] >= prompt_tokens[0] + 16  # both places hold the image's 16 tokens
