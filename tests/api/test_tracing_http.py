"""OpenTelemetry traces (api/telemetry.py): the real OTLP/HTTP exporter sends each request's span to
a receiver served in the test, which decodes the protobuf as a collector would."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from api.app import init
from api.state import STATE
from settings import ConfigError
from testing.fake_backend import FakeBehaviour, fake_backends
from tests.api.helpers import echo_settings, sse_events

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SECRET = "a sentence about my tax return"


class Receiver:
    """An OTLP/HTTP trace endpoint: the decoded spans it was sent, with their resources."""

    def __init__(self):
        self.bodies: list[bytes] = []

    async def handle(self, request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/x-protobuf"
        self.bodies.append(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    def spans(self) -> list[tuple[dict, object]]:
        out = []
        for body in self.bodies:
            export = ExportTraceServiceRequest.FromString(body)
            for resource_spans in export.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    out += [(resource, span) for span in scope.spans]
        return out


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def attributes(span) -> dict:
    return {a.key: _value(a.value) for a in span.attributes}


@pytest.fixture
async def receiver(aiohttp_server):
    r = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", r.handle)
    server = await aiohttp_server(app)
    r.url = str(server.make_url("/v1/traces"))
    return r


@pytest.fixture
def traced_client(aiohttp_client, tmp_path, tiny_model_dir, receiver):
    async def make(*extra: str):
        settings = echo_settings(
            tmp_path,
            tiny_model_dir,
            (f'telemetry.otlp_traces_endpoint="{receiver.url}"', 'telemetry.service_name="chat-test"', *extra),
        )
        app = init(settings, backend_factory=fake_backends(FakeBehaviour()))
        return await aiohttp_client(app, server_kwargs={"handler_cancellation": True})

    return make


async def flush(client) -> None:
    assert await asyncio.to_thread(client.app[STATE].tracing.provider.force_flush)


async def test_a_chat_request_is_one_span_in_the_callers_trace_with_genai_attributes(traced_client, receiver):
    client = await traced_client()
    body = {
        "model": "echo",
        "messages": [{"role": "user", "content": SECRET}],
        "max_tokens": 12,
        "temperature": 0.5,
        "seed": 7,
    }
    resp = await client.post(
        "/v1/chat/completions", json=body, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    )
    assert resp.status == 200
    answer = await resp.json()
    await flush(client)
    [(resource, span)] = receiver.spans()
    assert resource["service.name"] == "chat-test"
    assert span.name == "chat echo"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    a = attributes(span)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "echo"
    assert a["gen_ai.response.id"] == resp.headers["X-Request-Id"]
    assert a["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"] > 0
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert a["gen_ai.response.finish_reasons"] == [answer["choices"][0]["finish_reason"]]
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.seed"]) == (12, 0.5, 7)
    assert a["gen_ai.request.stream"] is False
    assert a["selfhosted.status"] == "finished" and a["selfhosted.tier"] == "enterprise"
    assert a["selfhosted.queue_ms"] >= 0 and a["selfhosted.ttft_ms"] >= a["selfhosted.queue_ms"]
    assert a["selfhosted.cost_usd"] > 0  # echo is priced
    events = {e.name: e.time_unix_nano for e in span.events}
    assert span.start_time_unix_nano <= events["admitted"] <= events["first_token"] <= span.end_time_unix_nano
    assert SECRET.encode() not in b"".join(receiver.bodies)  # no prompt or answer text


async def test_streams_and_completions_are_traced_and_requests_without_a_traceparent_start_their_own_trace(
    traced_client, receiver
):
    client = await traced_client()
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "echo2", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5},
    )
    assert resp.status == 200
    await sse_events(resp)
    # A malformed traceparent is ignored (W3C: start a new trace), never an error.
    resp = await client.post(
        "/v1/completions",
        json={"model": "echo", "prompt": "once upon", "max_tokens": 3},
        headers={"traceparent": "00-not-a-trace-id-01"},
    )
    assert resp.status == 200
    await flush(client)
    spans = {span.name: span for _, span in receiver.spans()}
    assert set(spans) == {"chat echo2", "text_completion echo"}
    stream = attributes(spans["chat echo2"])
    assert stream["gen_ai.request.stream"] is True and stream["gen_ai.usage.output_tokens"] > 0
    assert attributes(spans["text_completion echo"])["gen_ai.operation.name"] == "text_completion"
    assert all(not span.parent_span_id for span in spans.values())  # no traceparent: roots
    assert spans["chat echo2"].trace_id != spans["text_completion echo"].trace_id


async def test_the_last_spans_leave_when_the_server_stops(traced_client, receiver):
    client = await traced_client()
    resp = await client.post(
        "/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "bye"}]}
    )
    assert resp.status == 200
    assert receiver.spans() == []  # batched: nothing sent yet (the SDK waits up to 5 s)
    await client.close()  # the app's cleanup shuts the tracer provider down, which exports
    assert [span.name for _, span in receiver.spans()] == ["chat echo"]


async def test_tracing_is_off_by_default_and_a_bad_endpoint_stops_the_start(make_client, tmp_path, tiny_model_dir):
    client = await make_client()
    assert client.app[STATE].tracing is None
    settings = echo_settings(tmp_path, tiny_model_dir, ('telemetry.otlp_traces_endpoint="localhost:4318"',))
    with pytest.raises(ConfigError, match=r"telemetry\.otlp_traces_endpoint 'localhost:4318' is not an http"):
        init(settings, backend_factory=fake_backends(FakeBehaviour()))
