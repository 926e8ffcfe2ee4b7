"""POST /v1/embeddings (api/embeddings.py): the bundled all-MiniLM-L6-v2's sentence embeddings,
checked against sentence-transformers itself, through the HTTP API and the `openai` SDK."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from api.state import STATE
from gateway.safety.embedder import default_model_dir
from tests.api.helpers import assert_error, state_of

MODEL = "all-minilm-l6-v2"
TEXTS = [
    "How do I reset my router to its factory settings?",
    "The quarterly report is due on Friday.",
    "Paris is the capital of France.",
]
LONG = " ".join(f"word{i} and some more text" for i in range(120))  # well past 256 tokens


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' own encoder for the same shipped weights."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(default_model_dir()), device="cpu")
    return lambda texts: model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)


async def embed(client, **body):
    return await client.post("/v1/embeddings", json={"model": MODEL, **body})


def vectors(answer: dict) -> np.ndarray:
    assert [d["index"] for d in answer["data"]] == list(range(len(answer["data"])))
    assert all(d["object"] == "embedding" for d in answer["data"])
    return np.asarray([d["embedding"] for d in answer["data"]], dtype=np.float32)


async def test_embeddings_equal_sentence_transformers_and_are_billed(make_client, reference):
    client = await make_client()
    resp = await embed(client, input=[*TEXTS, LONG])
    assert resp.status == 200
    answer = await resp.json()
    assert answer["object"] == "list" and answer["model"] == MODEL
    got = vectors(answer)
    assert got.shape == (4, 384)
    # The long input is cut at 256 tokens, as sentence-transformers (max_seq_length 256) cuts it.
    np.testing.assert_allclose(got, reference([*TEXTS, LONG]), atol=1e-5)
    embedder = await client.app[STATE].embeddings.embedder()
    expected_tokens = sum(len(embedder.token_ids(t)) + 2 for t in TEXTS) + 256
    assert answer["usage"] == {"prompt_tokens": expected_tokens, "total_tokens": expected_tokens}
    assert "x-ratelimit-remaining-requests" in resp.headers
    usage = await (await client.get("/v1/usage")).json()
    assert usage["total"]["num_requests"] == 1 and usage["total"]["prompt_tokens"] == expected_tokens
    # One input, and token ids of the model's vocabulary, give the same vectors as the texts.
    one = vectors(await (await embed(client, input=TEXTS[1])).json())
    np.testing.assert_allclose(one[0], got[1], atol=1e-6)
    ids = [embedder.token_ids(t) for t in TEXTS[:2]]
    by_ids = vectors(await (await embed(client, input=ids)).json())
    np.testing.assert_allclose(by_ids, got[:2], atol=1e-6)
    single_ids = vectors(await (await embed(client, input=ids[0])).json())
    np.testing.assert_allclose(single_ids[0], got[0], atol=1e-6)


async def test_the_openai_sdk_gets_the_same_vectors_through_base64(make_client, reference):
    client = await make_client()
    store = client.app[STATE].store
    await store.create_org("acme", "enterprise")
    _, key = await store.create_key("acme")
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0) as sdk:
        result = await sdk.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64
        floats = await sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    got = np.asarray([d.embedding for d in result.data], dtype=np.float32)
    np.testing.assert_array_equal(got, np.asarray([d.embedding for d in floats.data], dtype=np.float32))
    np.testing.assert_allclose(got, reference(TEXTS), atol=1e-5)
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    raw = await (await embed(client, input="hi", encoding_format="base64")).json()
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").shape == (384,)


async def test_without_truncation_a_long_input_is_refused_naming_it(make_client):
    client = await make_client("embeddings.truncate=false")
    resp = await embed(client, input=["short", LONG])
    error = await assert_error(resp, 400, code="context_length_exceeded", param="input")
    assert "'input[1]'" in error["message"] and "256" in error["message"]


@pytest.mark.parametrize(
    ("body", "status", "param", "needle"),
    [
        ({"input": "x"}, 400, "model", "'model' is required"),
        ({"model": "text-embedding-3-small", "input": "x"}, 404, "model", "does not exist"),
        ({"model": MODEL}, 400, "input", "'input' must be"),
        ({"model": MODEL, "input": ""}, 400, "input", "must be a non-empty string"),
        ({"model": MODEL, "input": []}, 400, "input", "'input' must be"),
        ({"model": MODEL, "input": ["a", ""]}, 400, "input", "'input[1]'"),
        ({"model": MODEL, "input": ["a", 3]}, 400, "input", "'input[1]'"),
        ({"model": MODEL, "input": [[1, 2], []]}, 400, "input", "'input[1]'"),
        ({"model": MODEL, "input": [5, 10**9]}, 400, "input", "outside"),
        ({"model": MODEL, "input": [-1]}, 400, "input", "outside"),
        ({"model": MODEL, "input": ["a"] * 513}, 400, "input", "at most 512"),
        ({"model": MODEL, "input": "a", "dimensions": 256}, 400, "dimensions", "cannot be shortened"),
        ({"model": MODEL, "input": "a", "encoding_format": "int8"}, 400, "encoding_format", "'float' or 'base64'"),
        ({"model": MODEL, "input": "a", "truncate": True}, 400, "truncate", "Unrecognized"),
    ],
)
async def test_bad_requests_are_refused_naming_the_field(make_client, body, status, param, needle):
    client = await make_client()
    resp = await client.post("/v1/embeddings", json=body)
    error = await assert_error(resp, status, param=param)
    assert needle in error["message"]
    assert (await (await client.get("/v1/usage")).json())["total"]["num_requests"] == 0  # nothing billed


async def test_dimensions_of_384_and_a_user_are_accepted(make_client):
    client = await make_client()
    resp = await embed(client, input="hello", dimensions=384, user="someone")
    assert resp.status == 200


async def test_embeddings_count_against_the_callers_request_and_token_limits(make_client):
    client = await make_client("tiers.enterprise.requests_per_minute=2")
    assert (await embed(client, input="one")).status == 200
    assert (await embed(client, input="two")).status == 200
    resp = await client.post("/v1/embeddings", data=b"{not json", headers={"Content-Type": "application/json"})
    await assert_error(resp, 429, code="rate_limit_exceeded")  # before the body is read
    assert int(resp.headers["Retry-After"]) >= 1
    client = await make_client("tiers.enterprise.tokens_per_minute=50")
    resp = await embed(client, input=[LONG])  # 256 tokens against a bucket of 50
    await assert_error(resp, 429, code="rate_limit_exceeded")
    assert (await embed(client, input="fits")).status == 200  # the refused request took no tokens


async def test_an_organisation_over_its_budget_gets_429_insufficient_quota(make_client):
    client = await make_client("tiers.free.budget_fallback=true")  # a chat fallback; embeddings have none
    store = client.app[STATE].store
    await store.create_org("broke", "free", budget_usd=0.0)
    _key, secret = await store.create_key("broke")
    resp = await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=_bearer(secret))
    await assert_error(resp, 429, code="insufficient_quota")
    assert resp.headers["x-should-retry"] == "false"
    await store.create_org("solvent", "free", budget_usd=1.0)
    _key, secret = await store.create_key("solvent")
    resp = await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=_bearer(secret))
    assert resp.status == 200


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_embeddings_can_be_switched_off(make_client):
    client = await make_client("embeddings.enabled=false")
    assert client.app[STATE].embeddings is None
    await assert_error(await embed(client, input="x"), 404, code="model_not_found")


async def test_int8_activations_give_vectors_close_to_float32(make_client, reference):
    client = await make_client('embeddings.dtype="w8a8"')
    got = vectors(await (await embed(client, input=TEXTS)).json())
    cosine = (got * reference(TEXTS)).sum(axis=1)  # both L2-normalised
    assert cosine.min() > 0.98, cosine


async def test_beside_the_native_engine_embeddings_take_turns_with_its_steps(native_client, reference):
    # With a native CPU engine the encoder runs on its step thread between steps (PoolOwner):
    # a stream and an embeddings request at once both finish, the vectors unchanged.
    import asyncio

    async def chat():
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "stream": True}
        resp = await native_client.post("/v1/chat/completions", json=body)
        assert resp.status == 200
        return await resp.text()

    stream, resp = await asyncio.gather(chat(), embed(native_client, input=TEXTS * 4))
    assert "[DONE]" in stream
    assert resp.status == 200
    np.testing.assert_allclose(vectors(await resp.json()), reference(TEXTS * 4), atol=1e-5)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "torch"])
async def test_every_kernel_path_gives_sentence_transformers_vectors(make_client, reference, isa):
    # The encoder takes the engine's kernel choice (engine.kernel_isa): each path this CPU has.
    from engine.native import kernels

    if isa != "torch" and isa not in {m.value for m in kernels.supported_modes()}:
        pytest.skip(f"this CPU lacks {isa}")
    client = await make_client(f'engine.kernel_isa="{isa}"')
    got = vectors(await (await embed(client, input=[*TEXTS, LONG])).json())
    np.testing.assert_allclose(got, reference([*TEXTS, LONG]), atol=1e-5)


async def test_inputs_past_the_prompt_character_limit_are_refused_before_any_is_tokenized(make_client):
    """512 inputs of 32,000 characters cost 8 s of CPU tokenizing before the token bucket said no."""
    client = await make_client("server.max_prompt_chars=1000")
    service = state_of(client).embeddings
    tokenized = []
    token_ids = service.token_ids
    service.token_ids = lambda embedder, inputs, **kw: tokenized.append(inputs) or token_ids(embedder, inputs, **kw)
    resp = await embed(client, input=["x" * 600, "y" * 600])
    error = await assert_error(resp, 400, param="input")
    assert "1200 characters" in error["message"] and "1000" in error["message"] and tokenized == []
    assert (await embed(client, input=["x" * 400, "y" * 400])).status == 200 and len(tokenized) == 1
