"""A final assistant message continued (a prefill) on the real native engine: Anthropic's
Messages API does it whenever the last message is the assistant's, chat completions when asked
(`continue_final_message`, vLLM's name). The answer is exactly what the model writes after the
prefill's text, compared with a raw completion of the same rendered prompt."""

from __future__ import annotations

from tests.api.helpers import assert_error, state_of

ASK = {"role": "user", "content": "Tell me about the river."}
PREFILL = {"role": "assistant", "content": "The river is"}


async def _continuation_of(client, messages) -> str:
    """The raw completion of the prompt rendered with the last message left open."""
    tokenizer = state_of(client).models["tiny"].tokenizer
    ids = tokenizer.encode_chat(messages, continue_final_message=True)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return (await resp.json())["choices"][0]["text"]


async def test_the_messages_api_continues_an_assistant_prefill(native_client):
    expected = await _continuation_of(native_client, [ASK, PREFILL])
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [ASK, PREFILL]}
    resp = await native_client.post("/v1/messages", json=body)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert answer["content"][0]["text"] == expected
    counted = await native_client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": [ASK, PREFILL]})
    usage = answer["usage"]  # Anthropic's input_tokens leave out the prompt tokens read from cache
    assert (await counted.json())["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


async def test_chat_completions_continue_the_final_message_when_asked(native_client):
    expected = await _continuation_of(native_client, [ASK, PREFILL])
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [ASK, PREFILL]}
    resp = await native_client.post("/v1/chat/completions", json={**body, "continue_final_message": True})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"] == expected
    plain = await (await native_client.post("/v1/chat/completions", json=body)).json()  # a new turn, as before
    assert plain["usage"]["prompt_tokens"] > (await resp.json())["usage"]["prompt_tokens"]
    refused = await native_client.post(
        "/v1/chat/completions", json={**body, "messages": [ASK], "continue_final_message": True}
    )
    await assert_error(refused, 400, param="continue_final_message")
