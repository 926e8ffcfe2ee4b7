"""The Responses API shares chat completions' path: the same ledger, buckets and safety gate."""

from __future__ import annotations

from engine.types import RequestRejected
from tests.api.helpers import assert_error, state_of


async def respond(client, body, headers=None):
    return await client.post("/v1/responses", json={"model": "echo", **body}, headers=headers or {})


async def test_a_response_is_billed_in_the_same_ledger_as_a_chat_completion(make_client):
    client = await make_client()
    resp = await respond(client, {"input": "hello there", "store": False})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["object"] == "response" and body["output"][0]["content"][0]["text"] == "hello there"
    rows = await state_of(client).store.usage_summary(
        state_of(client).local_principal.org.id, start=0, end=None, group_by="model"
    )
    (row,) = rows
    assert row["num_requests"] == 1 and row["prompt_tokens"] == body["usage"]["input_tokens"]


async def test_the_request_bucket_is_shared_with_chat_completions(make_client):
    client = await make_client("tiers.enterprise.requests_per_minute=1")
    await client.post("/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]})
    resp = await respond(client, {"input": "again"})
    await assert_error(resp, 429)
    assert int(resp.headers["Retry-After"]) >= 1
    listed = await (await client.get("/v1/conversations")).json()
    assert listed["data"] == []  # a refused response leaves no conversation behind


async def test_function_call_items_and_their_outputs_go_back_through_the_template(make_client):
    client = await make_client()
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    resp = await respond(client, {"input": items})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    listed = await (await client.get(f"/v1/responses/{body['id']}/input_items?order=asc")).json()
    assert [i["type"] for i in listed["data"]] == ["message", "function_call", "function_call_output"]
    # OpenAI's paging: newest first by default, `limit`, `after` an item id; bad values are 400s.
    newest = await (await client.get(f"/v1/responses/{body['id']}/input_items?limit=2")).json()
    assert [i["type"] for i in newest["data"]] == ["function_call_output", "function_call"] and newest["has_more"]
    rest = await (await client.get(f"/v1/responses/{body['id']}/input_items?limit=2&after={newest['last_id']}")).json()
    assert [i["type"] for i in rest["data"]] == ["message"] and not rest["has_more"]
    for query, param in (("limit=0", "limit"), ("limit=abc", "limit"), ("order=zz", "order")):
        await assert_error(await client.get(f"/v1/responses/{body['id']}/input_items?{query}"), 400, param=param)
    await assert_error(await client.get(f"/v1/responses/{body['id']}/input_items?after=nope"), 404, param="after")
    bad = await respond(client, {"input": [{"type": "function_call_output", "call_id": "call_1"}]})
    await assert_error(bad, 400, param="input[0].output")


async def test_logprobs_a_backend_cannot_give_are_a_400_before_any_stream_opens(make_client):
    client = await make_client()
    backend = state_of(client).models["echo"].backend

    def check_request(request):  # as the TensorRT-LLM adapter refuses them: never silently dropped
        if request.sampling.logprobs is not None:
            raise RequestRejected(
                "logprobs are not supported by this backend", param="logprobs", code="unsupported_value"
            )

    backend.check_request = check_request
    resp = await respond(
        client, {"input": "hi", "stream": True, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    )
    await assert_error(resp, 400, code="unsupported_value", param="logprobs")
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "echo", "stream": True, "logprobs": True, "messages": [{"role": "user", "content": "hi"}]},
    )
    await assert_error(resp, 400, code="unsupported_value", param="logprobs")
    assert (await respond(client, {"input": "hi", "stream": True, "store": False})).status == 200


async def test_truncation_is_taken_and_echoed_as_on_chat_completions(make_client):
    client = await make_client()
    resp = await respond(client, {"input": "hi", "truncation": "auto"})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["truncation"] == "auto"
    assert (await (await respond(client, {"input": "hi"})).json())["truncation"] == "disabled"
    await assert_error(await respond(client, {"input": "hi", "truncation": "sometimes"}), 400, param="truncation")


async def test_errors_name_the_input_field_not_the_chat_message_it_became(make_client):
    client = await make_client()
    part = {"type": "input_file", "filename": "d.pdf", "file_data": "data:application/pdf;base64,@@@@"}
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Summarize"}, part]}]
    resp = await respond(client, {"input": items, "instructions": "Be brief."})
    body = await assert_error(resp, 400, param="input[0].content[1].file_data")
    assert "'input[0].content[1].file_data'" in body["message"]
