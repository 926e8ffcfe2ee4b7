"""Logprobs beside a stop string, over HTTP on the native engine (tiny Llama, random weights).

The rule, streamed or not, in chat (`logprobs.content`) and legacy completions
(`logprobs.tokens`): the logprobs are those of the tokens whose text is in the returned text, in
order, the token a stop string cuts included; the stop string's own tokens and those after it
are left out. The tiny model emits bytes that are no UTF-8 character (each is a U+FFFD of the
text), which used to give the token after one the start of the byte.
"""

from __future__ import annotations

import pytest

from tests.api.helpers import sse_events

PROMPT = "The river runs past the old mill and"
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True}
LEGACY = {"prompt": PROMPT, "logprobs": 0}


def _covering(token_bytes: list[bytes], text: str) -> int:
    """How many tokens the text needs: the fewest whose bytes, decoded, start with it."""
    for n in range(len(token_bytes) + 1):
        if b"".join(token_bytes[:n]).decode("utf-8", errors="replace").startswith(text):
            return n
    raise AssertionError(f"the tokens never spell {text!r}")


async def _answer(client, path: str, fields: dict, *, stream: bool) -> tuple[str, list[str], list[bytes]]:
    """(text, the tokens its logprobs name, their bytes)."""
    body = {"model": "tiny", "temperature": 0, "max_tokens": 24, "ignore_eos": True, **fields, "stream": stream}
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    if stream:
        chunks = [c["choices"][0] for c in (await sse_events(resp))[0] if isinstance(c, dict) and c["choices"]]
    else:
        chunks = (await resp.json())["choices"]
    text, tokens, token_bytes = "", [], []
    for choice in chunks:
        lp = choice.get("logprobs")
        if path.endswith("chat/completions"):
            text += (choice["delta"] if stream else choice["message"]).get("content") or ""
            entries = lp["content"] if lp else []
            tokens += [e["token"] for e in entries]
            token_bytes += [bytes(e["bytes"]) for e in entries]
        else:
            text += choice["text"]
            tokens += lp["tokens"] if lp else []
    if not path.endswith("chat/completions"):
        token_bytes = [t.encode() for t in tokens]
    return text, tokens, token_bytes


@pytest.mark.parametrize(("path", "fields"), [("/v1/chat/completions", CHAT), ("/v1/completions", LEGACY)])
async def test_logprobs_list_the_tokens_of_the_text_a_stop_string_cuts_streamed_or_not(native_client, path, fields):
    text, tokens, token_bytes = await _answer(native_client, path, fields, stream=False)
    assert len(tokens) == 24
    starts = [len(b"".join(token_bytes[:i]).decode("utf-8", errors="replace")) for i in range(len(tokens))]
    stops = {text[s : s + 2] for start in starts[1:16] for s in (start, start + 1)}  # across tokens, inside one
    for stop in sorted(s for s in stops if len(s) == 2):
        cut = text[: text.find(stop)]
        want = tokens[: _covering(token_bytes, cut)]
        for stream in (False, True):
            got_text, got_tokens, _ = await _answer(native_client, path, {**fields, "stop": [stop]}, stream=stream)
            assert (got_text, got_tokens) == (cut, want), (stop, stream)
