"""A Qwen3.5 checkpoint as released (the multimodal Qwen3_5ForConditionalGeneration layout, tiny
and random, with a tokenizer and chat template) served through the whole server on the native
engine: its language model answers a streamed chat completion, and an image gets a 400 (its
vision tower is not served)."""

from __future__ import annotations

import pytest

from api.app import init
from testing.tiny_model import QWEN3_5_TINY, build_tiny_family
from tests.api.helpers import assert_error, native_settings, sse_events, state_of
from tests.api.test_images_http import data_url, png_bytes


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5-http")
    return build_tiny_family(root / "tiny-qwen3_5", "qwen3_5", tokenizer=True, tie_word_embeddings=True, **QWEN3_5_TINY)


@pytest.fixture
async def client(aiohttp_client, tmp_path, qwen3_5_dir):
    settings = native_settings(tmp_path, qwen3_5_dir, "qwen")
    return await aiohttp_client(init(settings), server_kwargs={"handler_cancellation": True})


async def test_a_streamed_chat_answer_arrives_and_the_state_rows_come_back(client):
    body = {
        "model": "qwen",
        "messages": [{"role": "user", "content": "What does the word river mean?"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    events, _ = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    engine = state_of(client).models["qwen"].backend.engine
    assert engine.runner.recurrent is not None and engine.block_manager.num_used_slots == 0


async def test_an_image_is_refused_as_the_vision_tower_is_not_served(client):
    models = await (await client.get("/v1/models/qwen")).json()
    assert models["vision"] is False
    image = {"type": "image_url", "image_url": {"url": data_url(png_bytes())}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    resp = await client.post("/v1/chat/completions", json={"model": "qwen", "messages": messages, "stream": True})
    await assert_error(resp, 400, code="image_input_not_supported")
