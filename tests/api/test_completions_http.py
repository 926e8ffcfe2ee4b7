"""POST /v1/completions (the legacy text completion) over HTTP.

Against the real native engine (tiny Llama, random weights): a raw prompt is continued exactly
as transformers continues the same token ids (no chat template), as text or as token ids,
streamed or not, with OpenAI's legacy logprobs and echo, and billed in the usage ledger.
Against the fake backend: validation (each a 400 naming the field), the prompt reaching the
backend untemplated, and the safety gate's refusal in both of its modes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from api.completions import DEFAULT_MAX_TOKENS
from api.errors import ApiError
from api.prompt import encode_raw_prompt
from engine.tokenizer import Tokenizer
from engine.upstream.counting import EstimatingCounter
from settings import SafetyConfig
from tests.api.helpers import assert_error, sse_events, state_of

PROMPT = "The river runs past the old mill and"


@pytest.fixture
def native(native_client):
    return native_client


def _transformers_greedy(model_dir, ids: list[int], max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=10**9,  # never stops early (the request sets ignore_eos)
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


async def _complete(client, **fields) -> dict:
    body = {"model": "tiny", "temperature": 0, "max_tokens": 8, "ignore_eos": True, **fields}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_a_raw_prompt_is_continued_as_transformers_continues_its_tokens(native, tiny_model_dir):
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    ids = tokenizer.encode_prompt(PROMPT)
    expected = tokenizer.decode(_transformers_greedy(tiny_model_dir, ids, 8))
    body = await _complete(native, prompt=PROMPT)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": expected, "logprobs": None, "finish_reason": "length"}
    # No chat template around it: the prompt is exactly its own tokens.
    assert (
        body["usage"]["prompt_tokens"] == len(ids) < len(tokenizer.encode_chat([{"role": "user", "content": PROMPT}]))
    )
    assert body["usage"]["completion_tokens"] == 8
    # The same prompt as token ids (and as a one-element array of either) gives the same answer.
    for prompt in (ids, [ids], [PROMPT]):
        assert (await _complete(native, prompt=prompt))["choices"][0]["text"] == expected


async def test_streamed_text_equals_the_unary_answer_and_ends_with_usage(native):
    unary = (await _complete(native, prompt=PROMPT))["choices"][0]["text"]
    resp = await native.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": PROMPT,
            "temperature": 0,
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    events, _ = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == unary
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8


async def test_legacy_logprobs_name_each_token_with_its_offset(native):
    body = await _complete(native, prompt=PROMPT, logprobs=2)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == body["usage"]["completion_tokens"] == 8
    assert "".join(lp["tokens"]) == choice["text"]
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    assert lp["text_offset"] == offsets
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0.0 and len(top) == 2
        assert top[token] == pytest.approx(value, abs=1e-4) == max(top.values())  # greedy: the top choice


async def test_echo_puts_the_prompt_before_the_answer_and_n_gives_each_choice(native):
    plain = (await _complete(native, prompt=PROMPT))["choices"][0]["text"]
    body = await _complete(native, prompt=PROMPT, echo=True, n=2)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [PROMPT + plain] * 2  # greedy: both the same
    assert body["usage"]["completion_tokens"] == 16


async def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(native, tiny_model_dir):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1."""
    from transformers import AutoModelForCausalLM

    ids = Tokenizer.from_dir(tiny_model_dir).encode_prompt(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [logp[p - 1, ids[p]].item() for p in range(1, len(ids))]
    for _ in range(2):  # the second time the prompt's blocks are cached: its logprobs are still computed
        body = await _complete(native, prompt=[ids], echo=True, logprobs=1, max_tokens=1)
        (choice,) = body["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and choice["text"].startswith(PROMPT)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        assert "".join(lp["tokens"]) == choice["text"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_completions_are_billed_in_the_usage_ledger(native):
    body = await _complete(native, prompt=PROMPT)
    usage = await (await native.get("/v1/usage")).json()
    assert usage["total"]["num_requests"] == 1
    assert usage["total"]["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert usage["total"]["completion_tokens"] == 8


async def test_max_tokens_defaults_to_sixteen_as_openai_does(native):
    body = await native.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "ignore_eos": True})
    assert (await body.json())["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS == 16


# -- the fake backend: what reaches the model, validation, safety ---------------------------


async def test_the_prompt_reaches_the_backend_without_a_template(make_client):
    client = await make_client()
    prompt = "<|im_start|>user\nsay hello there<|im_end|>\n<|im_start|>assistant\n"
    resp = await client.post("/v1/completions", json={"model": "echo", "prompt": prompt, "max_tokens": 20})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["choices"][0]["text"] == "say hello there"  # the fake echoes the ChatML user turn it finds
    (request,) = state_of(client).models["echo"].backend.requests
    tokenizer = state_of(client).models["echo"].tokenizer
    assert list(request.prompt_token_ids) == tokenizer.encode_prompt(prompt)
    assert request.chat is not None and request.chat.prompt == prompt and request.chat.messages == ()  # for relays


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({}, "prompt", None),
        ({"prompt": 5}, "prompt", None),
        ({"prompt": []}, "prompt", None),
        ({"prompt": [1, "a"]}, "prompt", None),
        ({"prompt": ["one", "two"]}, "prompt", "unsupported_value"),
        ({"prompt": [1, 10**9]}, "prompt", None),
        ({"prompt": "x" * 2000}, "prompt", "string_above_max_length"),
        ({"prompt": "hi", "suffix": "bye"}, "suffix", None),
        ({"prompt": "hi", "best_of": 3}, "best_of", "unsupported_value"),
        ({"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "stream", "unsupported_value"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", None),
        ({"prompt": "hi", "logprobs": True}, "logprobs", None),
        ({"prompt": "hi", "echo": "yes"}, "echo", None),
        ({"prompt": "hi", "messages": []}, "messages", "unknown_parameter"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
        ({"prompt": "hi", "temperature": 3}, "temperature", None),
        ({"prompt": "hi", "model": "nope"}, "model", "model_not_found"),
    ],
)
async def test_bad_requests_get_a_400_naming_the_field(make_client, fields, param, code):
    client = await make_client("server.max_prompt_chars=1000")
    resp = await client.post("/v1/completions", json={"model": "echo", **fields})
    status = 404 if code == "model_not_found" else 400
    await assert_error(resp, status, code=code, param=param)
    assert state_of(client).models["echo"].backend.requests == []


async def test_a_prompt_past_the_context_is_a_400_naming_the_prompt(make_client):
    client = await make_client()
    words = " ".join(["river"] * 500)  # past the enterprise tier's 400-token context
    resp = await client.post("/v1/completions", json={"model": "echo", "prompt": words})
    error = await assert_error(resp, 400, code="context_length_exceeded", param="prompt")
    assert "in the prompt" in error["message"]


async def test_an_empty_prompt_without_a_start_token_is_refused(make_client):
    client = await make_client()
    await assert_error(await client.post("/v1/completions", json={"model": "echo", "prompt": ""}), 400, param="prompt")


def test_a_relayed_model_takes_a_text_prompt_but_not_token_ids():
    model = SimpleNamespace(name="relay", tokenizer=EstimatingCounter())
    ids, context = encode_raw_prompt(model, "hello there")  # type: ignore[arg-type]
    assert len(ids) == EstimatingCounter().count("hello there") and context[0].content == "hello there"
    with pytest.raises(ApiError) as err:
        encode_raw_prompt(model, (1, 2, 3))  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.param == "prompt" and "as text" in err.value.message
    with pytest.raises(ApiError, match="empty") as err:
        encode_raw_prompt(model, "")  # type: ignore[arg-type]
    assert err.value.param == "prompt"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_blocked_prompt_gets_the_refusal_as_its_text(make_client, stream):
    client = await make_client("safety.enabled=true", "safety.classifier=false")
    resp = await client.post(
        "/v1/completions", json={"model": "echo", "prompt": "how do I kill myself", "stream": stream}
    )
    assert resp.status == 200
    if stream:
        events, _ = await sse_events(resp)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        finish = events[-2]["choices"][0]["finish_reason"]
    else:
        body = await resp.json()
        text, finish = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
        assert body["usage"]["prompt_tokens"] == 0  # a refused prompt is not billed
    assert text == SafetyConfig().refusal_messages["self_harm"] and finish == "content_filter"
    assert state_of(client).models["echo"].backend.requests == []


async def test_in_error_mode_a_blocked_prompt_is_a_400_naming_the_prompt(make_client):
    client = await make_client("safety.enabled=true", "safety.classifier=false", 'safety.block_mode="error"')
    resp = await client.post("/v1/completions", json={"model": "echo", "prompt": "write me a keylogger"})
    await assert_error(resp, 400, code="content_policy_violation", param="prompt")
