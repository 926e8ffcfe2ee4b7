"""The HTTP surface in-process: wire format, SSE framing, headers, every error path, auth,
disconnects, billing once, conversations."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from api.attachments import OFF_LOOP_CHARS
from testing.fake_backend import FakeBehaviour
from tests.api.helpers import assert_error, sse_events, state_of

USER = [{"role": "user", "content": "Hello there, friend."}]


async def chat(client, body, headers=None):
    return await client.post("/v1/chat/completions", json=body, headers=headers or {})


async def ledger_rows(client):
    rows = await state_of(client).store.usage_summary(
        state_of(client).local_principal.org.id, start=0, end=None, group_by="model"
    )
    return {r["model"]: r for r in rows}


async def test_non_streaming_completion_has_openai_shape_and_headers(make_client):
    client = await make_client()
    resp = await chat(client, {"model": "echo", "messages": USER})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "echo"
    assert body["choices"][0]["message"]["content"] == "Hello there, friend."
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert (
        usage["completion_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert resp.headers["X-Request-Id"].startswith("req_")
    for h in ("limit", "remaining", "reset"):
        assert f"x-ratelimit-{h}-requests" in resp.headers and f"x-ratelimit-{h}-tokens" in resp.headers


async def test_stream_sends_role_first_then_content_then_finish_usage_and_done(make_client):
    client = await make_client()
    resp = await chat(
        client, {"model": "echo", "messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["Cache-Control"] == "no-cache" and resp.headers["X-Accel-Buffering"] == "no"
    assert resp.headers["X-Request-Id"].startswith("req_")
    events, _ = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello there, friend."
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


async def test_continuous_usage_stats_puts_running_counts_on_every_content_chunk(make_client):
    client = await make_client()
    resp = await chat(
        client,
        {
            "model": "echo",
            "messages": USER,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    events, _ = await sse_events(resp)
    content = [c for c in events[:-1] if c["choices"] and c["choices"][0]["delta"].get("content")]
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[0] >= 1 and len(set(counts)) == len(counts)
    final = events[-2]["usage"]
    assert final["completion_tokens"] == counts[-1] and final["prompt_tokens"] == content[0]["usage"]["prompt_tokens"]


async def test_model_text_that_looks_like_sse_framing_arrives_intact(make_client):
    client = await make_client()
    evil = "a\n\ndata: [DONE]\n\nb\r\nc"
    resp = await chat(client, {"model": "echo", "stream": True, "messages": [{"role": "user", "content": evil}]})
    events, _ = await sse_events(resp)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1] if c["choices"]) == evil


async def test_max_tokens_cuts_the_answer_with_finish_reason_length(make_client):
    client = await make_client()
    body = await (await chat(client, {"model": "echo", "messages": USER, "max_tokens": 2})).json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 2


async def test_heartbeat_comments_arrive_while_waiting_for_the_first_token(make_client):
    client = await make_client(behaviour=FakeBehaviour(token_delay_s=0.3))
    resp = await chat(client, {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    _, comments = await sse_events(resp)
    assert "processing" in comments


@pytest.mark.parametrize(
    "send, status, code, param",
    [
        (
            lambda c: c.post("/v1/chat/completions", data=b"{nope", headers={"Content-Type": "application/json"}),
            400,
            "invalid_json",
            None,
        ),
        (lambda c: c.post("/v1/chat/completions", json=[1]), 400, None, None),
        (
            lambda c: c.post("/v1/chat/completions", data=b"x", headers={"Content-Type": "text/plain"}),
            400,
            "invalid_content_type",
            None,
        ),
        (lambda c: chat(c, {"model": "echo"}), 400, "missing_required_parameter", "messages"),
        (lambda c: chat(c, {"model": "echo", "messages": USER, "temperature": -1}), 400, None, "temperature"),
        (lambda c: chat(c, {"model": "echo", "messages": USER, "stream": True, "n": 9}), 400, None, "n"),
        (lambda c: chat(c, {"model": "nope", "messages": USER}), 404, "model_not_found", None),
        (lambda c: chat(c, {"model": "echo", "messages": USER, "metadata": 5}), 400, None, "metadata"),
        (lambda c: chat(c, {"model": "echo", "messages": USER, "metadata": {"k": 5}}), 400, None, "metadata.k"),
        (
            lambda c: chat(c, {"model": "echo", "messages": USER, "metadata": {str(i): "v" for i in range(17)}}),
            400,
            None,
            "metadata",
        ),
        (
            lambda c: c.post("/v1/responses", json={"model": "echo", "input": "hi", "metadata": {"k": ["x"]}}),
            400,
            None,
            "metadata.k",
        ),
        (lambda c: chat(c, {"model": "echo", "messages": USER, "max_tokens": 65}), 400, None, "max_tokens"),
        (
            lambda c: chat(
                c, {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "word " * 600}]}
            ),
            400,
            "context_length_exceeded",
            "messages",
        ),
        (
            lambda c: c.post(
                "/v1/chat/completions", data=b"{" + b" " * 30000 + b"}", headers={"Content-Type": "application/json"}
            ),
            413,
            "request_too_large",
            None,
        ),
        (lambda c: c.get("/v1/nothing-here"), 404, "unknown_url", None),
        (lambda c: c.get("/v1/chat/completions"), 405, "method_not_allowed", None),
        (lambda c: c.get("/v1/conversations/conv_missing"), 404, None, "conversation_id"),
        (lambda c: c.get("/v1/conversations?limit=0"), 400, None, "limit"),
        (lambda c: c.get("/v1/conversations?after=conv_unknown"), 404, None, "after"),
        (lambda c: c.get("/v1/usage?group_by=planet"), 400, None, "group_by"),
        (
            lambda c: chat(c, {"model": "echo", "messages": USER, "conversation_id": "conv_nope"}),
            404,
            None,
            "conversation_id",
        ),
        (
            lambda c: c.post("/v1/chat/completions", json={"messages": USER}, headers={"Authorization": "Basic abc"}),
            401,
            "invalid_api_key",
            None,
        ),
    ],
)
async def test_every_error_path_renders_the_openai_envelope(make_client, send, status, code, param):
    client = await make_client()
    await assert_error(await send(client), status, code=code, param=param)
    assert (await client.get("/health")).status == 200  # and the server keeps serving


async def test_errors_before_a_stream_bill_nothing(make_client):
    client = await make_client()
    await chat(client, {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "word " * 600}]})
    assert await ledger_rows(client) == {}


async def test_a_completed_request_is_billed_exactly_once_with_its_cost(make_client):
    client = await make_client()
    body = await (await chat(client, {"model": "echo", "messages": USER})).json()
    rows = await ledger_rows(client)
    assert rows["echo"]["num_requests"] == 1
    assert rows["echo"]["completion_tokens"] == body["usage"]["completion_tokens"]
    expected = (body["usage"]["prompt_tokens"] * 1.0 + body["usage"]["completion_tokens"] * 2.0) / 1e6
    assert rows["echo"]["cost_usd"] == pytest.approx(expected)


async def test_client_disconnect_mid_stream_aborts_and_bills_generated_tokens(make_client):
    client = await make_client(behaviour=FakeBehaviour(token_delay_s=0.05))
    long_text = " ".join(["word"] * 60)
    resp = await chat(client, {"model": "echo", "stream": True, "messages": [{"role": "user", "content": long_text}]})
    for _ in range(200):  # read until tokens are flowing
        line = await resp.content.readline()
        assert line, "the stream ended before any token"
        if b'"content":"' in line and b'"content":""' not in line:
            break
    resp.close()  # the client goes away
    backend = state_of(client).models["echo"].backend
    for _ in range(100):
        rows = await ledger_rows(client)
        if rows:
            break
        await asyncio.sleep(0.05)
    assert len(backend.aborted) == 1
    assert backend.stats().num_running == 0
    row = rows["echo"]
    assert row["num_requests"] == 1 and 0 < row["completion_tokens"] < 60


async def test_keyless_requests_are_refused_when_not_on_loopback(make_client):
    client = await make_client('server.host="0.0.0.0"')
    await assert_error(await chat(client, {"messages": USER}), 401, code="invalid_api_key")
    await assert_error(
        await chat(client, {"messages": USER}, headers={"Authorization": "Bearer sk-wrong"}),
        401,
        code="invalid_api_key",
    )
    assert (await client.get("/health")).status == 200


async def test_require_keys_refuses_keyless_requests_even_on_loopback(make_client):
    client = await make_client("server.require_keys=true")
    await assert_error(await chat(client, {"messages": USER}), 401, code="invalid_api_key")


async def test_an_api_key_authenticates_and_its_tier_picks_the_model(make_client):
    client = await make_client()
    store = state_of(client).store
    await store.create_org("acme", "free")
    _key, secret = await store.create_key("acme")
    resp = await chat(client, {"messages": USER}, headers={"Authorization": f"Bearer {secret}"})
    assert resp.status == 200 and (await resp.json())["model"] == "echo2"
    models = await (await client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})).json()
    assert [m["id"] for m in models["data"]] == ["echo2"]
    config_json = Path(state_of(client).models["echo2"].config.path) / "config.json"
    assert models["data"][0]["created"] == int(config_json.stat().st_mtime) > 0  # OpenAI's unix time
    await assert_error(
        await chat(client, {"model": "echo", "messages": USER}, headers={"Authorization": f"Bearer {secret}"}),
        404,
        code="model_not_found",
    )


async def test_a_conversation_created_with_a_title_keeps_it(make_client):
    client = await make_client()
    made = await (await client.post("/v1/conversations", json={"title": "Trip plans"})).json()
    assert made["title"] == "Trip plans"
    assert (await (await client.get(f"/v1/conversations/{made['id']}")).json())["title"] == "Trip plans"
    untitled = await client.post("/v1/conversations")  # no body at all
    assert untitled.status == 201 and (await untitled.json())["title"] is None
    await assert_error(await client.post("/v1/conversations", json={"title": 5}), 400, param="title")


async def test_conversation_turns_are_stored_and_isolated_per_organisation(make_client):
    client = await make_client()
    conv = await (await client.post("/v1/conversations", json={})).json()
    cid = conv["id"]
    body = await (await chat(client, {"model": "echo", "messages": USER, "conversation_id": cid})).json()
    assert body["conversation_id"] == cid and body["history_messages_dropped"] == 0
    second = [{"role": "user", "content": "Second question."}]
    body = await (await chat(client, {"model": "echo", "messages": second, "conversation_id": cid})).json()
    assert body["usage"]["prompt_tokens"] > 20  # the history is in the prompt
    got = await (await client.get(f"/v1/conversations/{cid}")).json()
    assert [(m["role"], m["content"]) for m in got["messages"]] == [
        ("user", USER[0]["content"]),
        ("assistant", USER[0]["content"]),
        ("user", "Second question."),
        ("assistant", "Second question."),
    ]
    assert got["title"]  # from the first user message
    assert got["messages"][1]["model"] == "echo" and got["messages"][1]["tokens"] > 0
    store = state_of(client).store
    await store.create_org("other", "free")
    _k, secret = await store.create_key("other")
    await assert_error(
        await client.get(f"/v1/conversations/{cid}", headers={"Authorization": f"Bearer {secret}"}),
        404,
        param="conversation_id",
    )


async def test_a_stored_answer_carries_the_usage_its_chat_completion_reported(make_client):
    """The answer's usage as billed (tokens, cached tokens, cost), read from the ledger: a
    reloaded conversation shows what the live answer did."""
    client = await make_client()
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    first = await (await chat(client, {"model": "echo", "messages": USER, "conversation_id": cid})).json()
    second = {"model": "echo", "messages": [{"role": "user", "content": "Second question."}], "conversation_id": cid}
    streamed = await chat(client, {**second, "stream": True, "stream_options": {"include_usage": True}})
    events, _ = await sse_events(streamed)
    live = [first["usage"], next(e["usage"] for e in events[:-1] if e.get("usage"))]
    assert all(u["cost_usd"] > 0 for u in live)

    got = await (await client.get(f"/v1/conversations/{cid}")).json()
    answers = [m for m in got["messages"] if m["role"] == "assistant"]
    assert [a["usage"] for a in answers] == live
    assert [a["tokens"] for a in answers] == [u["completion_tokens"] for u in live]
    assert not any("usage" in m for m in got["messages"] if m["role"] == "user")
    assert not any("fallback_from" in m for m in got["messages"])
    kept = await (await client.post(f"/v1/conversations/{cid}/truncate", json={"keep_messages": 2})).json()
    assert kept["messages"][1]["usage"] == answers[0]["usage"]


async def test_long_conversation_history_drops_oldest_messages_and_says_so(make_client):
    client = await make_client()
    cid = (await (await client.post("/v1/conversations", json={"title": "long"})).json())["id"]
    for i in range(8):
        msg = [{"role": "user", "content": f"turn {i} " + "lorem ipsum " * 12}]
        body = await (
            await chat(client, {"model": "echo", "messages": msg, "conversation_id": cid, "max_tokens": 40})
        ).json()
        assert "error" not in body, body
    assert body["history_messages_dropped"] > 0
    assert body["usage"]["prompt_tokens"] + 40 <= 400
    stored = (await (await client.get(f"/v1/conversations/{cid}")).json())["messages"]
    assert stored[-1]["history_messages_dropped"] == body["history_messages_dropped"]  # the UI's note, after a reload
    assert "history_messages_dropped" not in stored[1]  # the first answer saw the whole conversation


async def test_conversation_rename_list_delete(make_client):
    client = await make_client()
    ids = [(await (await client.post("/v1/conversations", json={"title": f"c{i}"})).json())["id"] for i in range(3)]
    listing = await (await client.get("/v1/conversations?limit=2")).json()
    assert [c["id"] for c in listing["data"]] == ids[::-1][:2] and listing["has_more"]
    renamed = await (await client.patch(f"/v1/conversations/{ids[0]}", json={"title": "New name"})).json()
    assert renamed["title"] == "New name"
    assert (await client.delete(f"/v1/conversations/{ids[1]}")).status == 200
    await assert_error(await client.get(f"/v1/conversations/{ids[1]}"), 404)
    await assert_error(await client.patch(f"/v1/conversations/{ids[0]}", json={"title": ""}), 400, param="title")


async def test_health_ready_and_metrics(make_client):
    client = await make_client()
    assert (await client.get("/health")).status == 200
    ready = await client.get("/ready")
    assert ready.status == 200 and (await ready.json())["status"] == "ready"
    await chat(client, {"model": "echo", "messages": USER})
    text = await (await client.get("/metrics")).text()
    assert "tokens" in text


async def test_usage_totals_are_summed_as_decimals(make_client):
    from decimal import Decimal

    client = await make_client()
    costs = []
    for _ in range(3):
        body = await (await chat(client, {"model": "echo", "messages": USER})).json()
        costs.append(Decimal(str(body["usage"]["cost_usd"])))
    usage = await (await client.get("/v1/usage")).json()
    assert Decimal(str(usage["total"]["cost_usd"])) == sum(costs)
    assert len(repr(usage["total"]["cost_usd"])) <= 12  # no 5.199999999999997e-05


async def test_a_prompt_tokenized_off_the_loop_is_refused_the_same_way(make_client):
    """Past OFF_LOOP_CHARS the prompt is tokenized on a worker thread; its 400 is the same."""
    client = await make_client("server.max_body_bytes=200000", "server.max_prompt_chars=200000")
    long = [{"role": "user", "content": "word " * (OFF_LOOP_CHARS // 5 + 1)}]
    resp = await chat(client, {"model": "echo", "messages": long, "stream": True})
    await assert_error(resp, 400, code="context_length_exceeded", param="messages")
    assert (await chat(client, {"model": "echo", "messages": USER})).status == 200


async def test_an_answer_the_engine_cut_ends_without_done_and_is_stored_as_error(make_client):
    """A server-side failure mid-stream: an error event and no [DONE] (which means stored and
    billed as complete); the partial answer is kept with finish_reason "error" so that after a
    reload it does not pass for a complete one."""
    client = await make_client(behaviour=FakeBehaviour(fail_after=2))
    cid = (await (await client.post("/v1/conversations", json={})).json())["id"]
    long = [{"role": "user", "content": "one two three four five six"}]
    resp = await chat(client, {"model": "echo", "messages": long, "stream": True, "conversation_id": cid})
    events, _ = await sse_events(resp)
    assert events[-1] != "[DONE]" and events[-1]["error"]["code"] == "engine_error"
    messages = (await (await client.get(f"/v1/conversations/{cid}")).json())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["finish_reason"] == "error"
    assert messages[1]["content"]  # what was sent before the failure


async def test_a_body_over_the_limit_says_what_to_do_instead(make_client):
    client = await make_client()
    image = "data:image/png;base64," + "A" * 30000  # an inline image past server.max_body_bytes
    content = [{"type": "image_url", "image_url": {"url": image}}]
    resp = await chat(client, {"model": "echo", "messages": [{"role": "user", "content": content}]})
    error = await assert_error(resp, 413, code="request_too_large")
    assert "server.max_body_bytes" in error["message"] and "POST /v1/files" in error["message"]


async def test_a_body_of_millions_of_empty_arrays_is_refused_before_it_is_parsed(make_client):
    """Parsing holds the event loop (~0.3 us an array): 20 MB of `[],` froze it for 2.3 s. A body
    may hold max_prompt_chars brackets in its text plus 100,000 arrays and objects of structure."""
    client = await make_client("server.max_prompt_chars=10", "server.max_body_bytes=400000")
    many = b'{"model": "echo", "messages": [' + b"[]," * 100_010 + b'{"role": "user", "content": "hi"}]}'
    resp = await client.post("/v1/chat/completions", data=many, headers={"Content-Type": "application/json"})
    error = await assert_error(resp, 400, code="invalid_json")
    assert "100013 JSON arrays and objects" in error["message"]
    fits = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=fits)).status == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "/v1/files", "/v1/models"])
async def test_a_body_whose_content_encoding_does_not_decode_is_a_400(make_client, path, encoding):
    """Bytes sent as gzip or deflate that are neither: 400 malformed_http (was a 500 with a traceback)."""
    client = await make_client()
    method = client.get if path == "/v1/models" else client.post
    content_type = "multipart/form-data; boundary=XX" if path == "/v1/files" else "application/json"
    headers = {"Content-Type": content_type, "Content-Encoding": encoding}
    resp = await method(path, data=b"these bytes are not compressed", headers=headers)
    error = await assert_error(resp, 400, code="malformed_http")
    assert encoding in error["message"]
    fits = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await chat(client, fits)).status == 200
