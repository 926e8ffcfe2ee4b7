"""Single requests within the documented limits whose cost is bounded before the costly work.

Tools' text counts toward server.max_prompt_chars (and toward tokenizing off the event loop); a
prompt certainly past the context is refused before it is tokenized (engine/token_bound.py's
bound, which never refuses a prompt that fits); a token-id prompt longer than the context is
refused before its ids are checked or decoded; a long stored history is trimmed tokenizing about
what fits, with the same result as before. The spies count what reached the tokenizer.
"""

from __future__ import annotations

import json
import random
import threading
import types

import pytest

import engine.tokenizer as tokenizer_module
from api.attachments import OFF_LOOP_CHARS
from api.prompt import build_context, encode_chat, trim_history
from api.protocol import ChatMessage
from engine.tokenizer import PromptTooLong, Tokenizer
from tests.api.helpers import assert_error, state_of

NON_LATIN = [chr(c) for c in range(0x800, 0x2FFF)]
LIMITS = ("server.max_body_bytes=2000000", "server.max_prompt_chars=300000")  # the context stays 400 tokens


def text_of(num_chars: int, seed: int = 0) -> str:
    return "".join(random.Random(seed).choices(NON_LATIN, k=num_chars))


@pytest.fixture
def tokenized(monkeypatch) -> list[tuple[int, int]]:
    """(characters, thread id) of every text the tokenizer encoded, through its one encoding path
    (each test clears it once its app has started)."""
    calls: list[tuple[int, int]] = []
    real = tokenizer_module._encode

    def spy(tok, text: str, *, add_special_tokens: bool) -> list[int]:
        calls.append((len(text), threading.get_ident()))
        return real(tok, text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tokenizer_module, "_encode", spy)
    return calls


def chat_tool(description: str) -> dict:
    return {"type": "function", "function": {"name": "lookup", "description": description, "parameters": {}}}


def tools_body(path: str, description: str) -> dict:
    """A request to `path` carrying one tool with this description, in that API's shape."""
    if path == "/v1/responses":
        tool = {"type": "function", "name": "lookup", "description": description, "parameters": {}}
        return {"model": "echo", "input": "hi", "tools": [tool]}
    if path.startswith("/v1/messages"):
        tool = {"name": "lookup", "description": description, "input_schema": {"type": "object"}}
        return {"model": "echo", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    return {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "tools": [chat_tool(description)]}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"])
async def test_tools_text_counts_toward_max_prompt_chars_before_anything_is_tokenized(make_client, tokenized, path):
    client = await make_client("server.max_prompt_chars=5000", "server.max_body_bytes=100000")
    tokenized.clear()  # what the start tokenized
    resp = await client.post(path, json=tools_body(path, "d" * 6000))
    assert resp.status == 400, await resp.text()
    if path.startswith("/v1/messages"):  # Anthropic's envelope names the field in the message
        error = (await resp.json())["error"]
        assert error["type"] == "invalid_request_error" and "(param: tools)" in error["message"]
    else:
        await assert_error(resp, 400, code="context_length_exceeded", param="tools")
    assert tokenized == []


async def test_the_messages_and_the_tools_share_one_character_limit(make_client):
    client = await make_client("server.max_prompt_chars=5000", "server.max_body_bytes=100000")
    body = {"model": "echo", "messages": [{"role": "user", "content": "m" * 3000}], "tools": [chat_tool("d" * 2500)]}
    err = await assert_error(
        await client.post("/v1/chat/completions", json=body), 400, code="context_length_exceeded", param="messages"
    )
    assert "3000 in the messages" in err["message"] and "the limit is 5000" in err["message"]
    counted = tools_body("/v1/messages/count_tokens", "d" * 1500)
    counted["messages"][0]["content"] = "m" * 3000  # 4,500 characters in all: counted
    resp = await client.post("/v1/messages/count_tokens", json=counted)
    assert resp.status == 200, await resp.text()
    counted["tools"][0]["description"] = "d" * 2500
    assert (await client.post("/v1/messages/count_tokens", json=counted)).status == 400


async def test_count_tokens_tokenizes_long_tools_off_the_event_loop(make_client, tokenized):
    client = await make_client(*LIMITS)
    tokenized.clear()  # what the start tokenized
    body = tools_body("/v1/messages/count_tokens", "lorem ipsum " * (OFF_LOOP_CHARS // 12 + 1))
    resp = await client.post("/v1/messages/count_tokens", json=body)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["input_tokens"] > OFF_LOOP_CHARS // 12
    assert tokenized and all(thread != threading.get_ident() for _, thread in tokenized)


PAST_THE_CONTEXT = {
    "/v1/chat/completions": lambda text: {"model": "echo", "messages": [{"role": "user", "content": text}]},
    "/v1/completions": lambda text: {"model": "echo", "prompt": text},
    "/v1/responses": lambda text: {"model": "echo", "input": text},
    "/v1/messages": lambda text: {"model": "echo", "max_tokens": 5, "messages": [{"role": "user", "content": text}]},
}


@pytest.mark.parametrize("path", PAST_THE_CONTEXT)
async def test_a_prompt_certainly_past_the_context_is_refused_before_it_is_tokenized(make_client, tokenized, path):
    client = await make_client(*LIMITS)
    tokenized.clear()  # what the start tokenized
    resp = await client.post(path, json=PAST_THE_CONTEXT[path](text_of(200_000)))
    assert resp.status == 400, await resp.text()
    body = await resp.json()
    message = body["error"]["message"]
    assert "maximum context length is 400 tokens" in message and "at least" in message
    assert sum(num_chars for num_chars, _ in tokenized) < 1000  # the long text never reached the tokenizer


async def test_a_long_new_message_in_a_conversation_is_refused_before_it_is_tokenized(make_client, tokenized):
    client = await make_client(*LIMITS)
    tokenized.clear()  # what the start tokenized
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    body = {"model": "echo", "conversation_id": cid, "messages": [{"role": "user", "content": text_of(200_000)}]}
    await assert_error(await client.post("/v1/chat/completions", json=body), 400, code="context_length_exceeded")
    assert sum(num_chars for num_chars, _ in tokenized) < 1000


async def test_a_token_id_prompt_longer_than_the_context_is_refused_before_its_ids_are_checked(
    make_client, monkeypatch
):
    client = await make_client(*LIMITS)
    decoded: list[int] = []
    tokenizer = state_of(client).models["echo"].tokenizer
    real_decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: decoded.append(len(ids)) or real_decode(ids, **kw))
    prompt = [1] * 5000 + [10**9]  # the id outside the vocabulary is never looked at
    err = await assert_error(
        await client.post("/v1/completions", json={"model": "echo", "prompt": prompt, "max_tokens": 1}),
        400,
        code="context_length_exceeded",
        param="prompt",
    )
    assert "5001 in the prompt" in err["message"] and decoded == []
    assert "at least" not in err["message"]  # ids are counted: the figure is exact
    client = await make_client("server.max_prompt_chars=1000")
    await assert_error(
        await client.post("/v1/completions", json={"model": "echo", "prompt": [1] * 1001}),
        400,
        code="array_above_max_length",
        param="prompt",
    )


async def test_a_long_token_id_prompt_is_checked_and_decoded_off_the_event_loop(make_client, monkeypatch):
    client = await make_client(*LIMITS, "models.echo.max_model_len=40000", "tiers.enterprise.max_context_tokens=40000")
    threads: list[int] = []
    tokenizer = state_of(client).models["echo"].tokenizer
    real_decode = tokenizer.decode

    def decode(ids, **kw):
        threads.append(threading.get_ident())
        return real_decode(ids, **kw)

    monkeypatch.setattr(tokenizer, "decode", decode)
    body = {"model": "echo", "prompt": [1] * (OFF_LOOP_CHARS + 10), "max_tokens": 1}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert threads[0] != threading.get_ident()  # the prompt's decode, before the answer's


async def test_trimming_a_long_stored_history_tokenizes_about_what_fits(make_client, tokenized):
    client = await make_client(*LIMITS)
    tokenized.clear()  # what the start tokenized
    items = [
        {"type": "message", "role": "user" if i % 2 == 0 else "assistant", "content": text_of(5000, seed=i)}
        for i in range(20)
    ]
    made = await client.post("/v1/conversations", json={"items": items})
    assert made.status == 201, await made.text()
    body = {
        "model": "echo",
        "conversation_id": (await made.json())["id"],
        "messages": [{"role": "user", "content": "hi"}],
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["history_messages_dropped"] == 20  # no stored turn fits 400 tokens
    assert sum(num_chars for num_chars, _ in tokenized) < 5000  # less than one stored turn was tokenized


# -- the bound never refuses a prompt that fits ------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


PIECES = ["ab", " ", "  ", "\n", '"', "'", "“", "”", "é", "e\u0301", "漢字", "🙂", "<|im_start|>", "<|im_end|>", "{x}"]


def random_chats(num: int) -> list[list[dict]]:
    rng = random.Random(7)
    chats = []
    for _ in range(num):
        chat = [
            {"role": role, "content": "".join(rng.choices(PIECES, k=rng.randint(0, 120)))}
            for role in rng.choice([["user"], ["system", "user"], ["user", "assistant", "user"]])
        ]
        chats.append(chat)
    return chats


def test_the_bound_never_exceeds_the_token_count(tokenizer):
    bound = tokenizer._bound
    assert bound is not None  # byte-level BPE: the bound applies
    for chat in random_chats(300):
        for text in (m["content"] for m in chat):
            for tok, is_literal in ((tokenizer._tok, False), (tokenizer._literal_tok, True)):
                exact = len(tok.encode(text, add_special_tokens=False).ids)
                assert bound.min_num_tokens(tok, text, is_literal=is_literal, stop_above=10**9) <= exact, text


@pytest.mark.parametrize("continue_final", [False, True])
def test_a_prompt_that_fits_is_tokenized_exactly_and_one_past_the_limit_is_refused_only_when_longer(
    tokenizer, continue_final
):
    num_refused = 0
    for chat in random_chats(200):
        if continue_final:
            chat = [*chat, {"role": "assistant", "content": chat[-1]["content"]}]
        ids = tokenizer.encode_chat(chat, continue_final_message=continue_final)
        assert tokenizer.encode_chat(chat, continue_final_message=continue_final, max_num_tokens=len(ids)) == ids
        for limit in (0, len(ids) // 16, len(ids) // 4, len(ids) - 1):
            try:
                got = tokenizer.encode_chat(chat, continue_final_message=continue_final, max_num_tokens=limit)
            except PromptTooLong as exc:
                assert limit < exc.num_tokens <= len(ids)
                num_refused += 1
            else:
                assert got == ids
    assert num_refused > 100  # the bound was tried, not skipped


def old_trim(model, history, new, budget):
    """trim_history as it was before the bound (every step tried is tokenized): its result is kept."""
    steps = [(list(history), 0)]
    kept, dropped = list(history), 0
    while droppable := [i for i, m in enumerate(kept) if m.role != "system"]:
        span = 2 if droppable[0] + 1 < len(kept) and kept[droppable[0] + 1].role == "assistant" else 1
        del kept[droppable[0] : droppable[0] + span]
        dropped += span
        steps.append((list(kept), dropped))

    def attempt(k):
        context = build_context(steps[k][0], new)
        return encode_chat(model, context), context

    ids, context = attempt(0)
    if len(ids) <= budget or len(steps) == 1:
        return ids, context, 0
    last = len(steps) - 1
    ids, context = attempt(last)
    if len(ids) > budget:
        return ids, context, steps[last][1]
    low, high, best = 0, last, (ids, context)
    while high - low > 1:
        mid = (low + high) // 2
        ids, context = attempt(mid)
        if len(ids) <= budget:
            high, best = mid, (ids, context)
        else:
            low = mid
    return best[0], best[1], steps[high][1]


@pytest.mark.parametrize("budget", [20, 60, 150, 300, 1000])
def test_trimming_with_the_bound_drops_what_the_plain_bisection_dropped(tokenizer, budget):
    model = types.SimpleNamespace(
        tokenizer=tokenizer, serves_chat=True, name="tiny", config=types.SimpleNamespace(backend="native")
    )
    rng = random.Random(budget)
    for _ in range(20):
        history = [ChatMessage("system", "be brief")]
        for i in range(rng.randint(1, 8)):
            size = rng.choice([5, 40, 400, 3000])
            history += [ChatMessage("user", text_of(size, seed=i)), ChatMessage("assistant", "ok " * (size // 8))]
        new = (ChatMessage("user", "and now?"),)
        assert trim_history(model, history, new, budget) == old_trim(model, history, new, budget)  # type: ignore[arg-type]


def test_a_sentencepiece_style_tokenizer_with_byte_fallback_gets_a_sound_bound():
    """Llama 2 / Mistral layout: BPE with `<unk>`, fuse_unk and byte fallback. Its tokenizer.json
    names an unknown token, but byte fallback means it is never emitted: the bound applies."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, trainers

    from engine.token_bound import TokenBound

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    tok.train_from_iterator(["the river runs to the sea", "a wide sea and a long river"] * 50, trainer)
    bound = TokenBound.of(tok)
    assert bound is not None
    rng = random.Random(3)
    for _ in range(200):
        text = "".join(rng.choices(PIECES, k=rng.randint(1, 80)))
        exact = len(tok.encode(text, add_special_tokens=False).ids)
        assert bound.min_num_tokens(tok, text, is_literal=False, stop_above=10**9) <= exact, text


def wide_schema(num_chars: int) -> dict:
    props, i = {}, 0
    while len(json.dumps(props)) < num_chars:
        props[f"field_{i}"] = {"type": "string", "enum": [f"value_{i}_{k}" for k in range(8)]}
        i += 1
    return {"type": "object", "properties": props}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_a_big_bodys_schemas_compile_off_the_event_loop(make_client, monkeypatch, path):
    from api import tools

    compiled: list[int] = []
    real = tools.grammar_text

    def spy(structured):
        compiled.append(threading.get_ident())
        return real(structured)

    monkeypatch.setattr(tools, "grammar_text", spy)
    client = await make_client("server.max_body_bytes=200000")
    for num_chars, off_loop in ((300, False), (40_000, True)):  # around OFF_LOOP_CHARS (32,768) of body
        compiled.clear()
        schema = wide_schema(num_chars)
        if path == "/v1/responses":
            tool = {"type": "function", "name": "lookup", "parameters": schema}
            body = {"model": "echo", "input": "hi", "tools": [tool], "max_output_tokens": 4}
        else:
            body = tools_body(path, "look it up")
            body["tools"][0]["function"]["parameters"] = schema
            body["max_tokens"] = 4
        resp = await client.post(path, json=body)
        if resp.status != 200:  # too long for the tier's 400-token context: parsed (compiled) first
            assert (await resp.json())["error"]["code"] == "context_length_exceeded"
        assert compiled and all((thread != threading.get_ident()) is off_loop for thread in compiled)
