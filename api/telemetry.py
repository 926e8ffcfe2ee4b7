"""OpenTelemetry traces of generating requests (`telemetry.otlp_traces_endpoint`; off by default).

One span per request that reached generation or a refusal, written when the request is billed
(api/finish.py -> AppState.record), named and described as OpenTelemetry's GenAI semantic
conventions ask: "{gen_ai.operation.name} {gen_ai.request.model}", with the request's sampling
parameters, the model that answered, token usage (prompt-cache hits included), finish reasons
and the response id (the X-Request-Id). This server's own attributes carry `selfhosted.`: tier,
organisation and key ids, status, queue and first-token times, cost, the model fallen back
from. Span events mark when the queue admitted the request and when its first token came.
No prompt or answer text is recorded.

A request carrying a W3C `traceparent` header joins the caller's trace (an agent framework or a
proxy that traces its own calls). The spans leave in batches from the SDK's background thread
by OTLP over HTTP (protobuf): the request path only builds the span. Each app has its own
tracer provider (tests build many apps), shut down, and so flushed, when the server stops.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from settings import ConfigError, TelemetryConfig
from store.types import RequestStatus

if TYPE_CHECKING:
    from api.job import Job
    from engine.types import FinishReason
    from store.types import RequestRecord

log = structlog.get_logger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()


def check_config(cfg: TelemetryConfig) -> None:
    url = cfg.otlp_traces_endpoint
    if url and not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"telemetry.otlp_traces_endpoint {url!r} is not an http(s) URL (e.g. http://localhost:4318/v1/traces)"
        )


class Tracing:
    def __init__(self, cfg: TelemetryConfig, exporter: SpanExporter | None = None):
        """exporter: where spans go (tests pass an in-memory one); None: OTLP/HTTP to the endpoint.
        The exporter also reads OpenTelemetry's own variables, e.g. OTEL_EXPORTER_OTLP_TRACES_HEADERS."""
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=cfg.otlp_traces_endpoint, timeout=cfg.export_timeout_s)
        self.provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, export_timeout_millis=cfg.export_timeout_s * 1000)
        )
        self.tracer = self.provider.get_tracer("selfhosted-chat")
        log.info("tracing_on", endpoint=cfg.otlp_traces_endpoint or "(in process)", service_name=cfg.service_name)

    @staticmethod
    def parent_of(headers: Mapping[str, str]) -> Context | None:
        """The caller's trace context (W3C traceparent), if it sent one."""
        return _PROPAGATOR.extract(headers) if "traceparent" in headers else None

    def record(self, job: Job, record: RequestRecord, finish: FinishReason | None) -> None:
        """The span of one finished request, from its arrival to now."""

        def wall_ns(monotonic_s: float) -> int:  # a job's instants are monotonic; spans take wall time
            return int((record.created_at + monotonic_s - job.arrival_s) * 1e9)

        chat = job.chat
        operation = "text_completion" if chat.raw_prompt is not None else "chat"
        requested = chat.model or job.fallback_from or job.model.name
        attributes: dict[str, str | int | float | bool | list[str]] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "selfhosted-chat",
            "gen_ai.request.model": requested,
            "gen_ai.response.model": job.model.name,
            "gen_ai.response.id": record.request_id,
            "gen_ai.request.temperature": chat.temperature,
            "gen_ai.request.top_p": chat.top_p,
            "gen_ai.request.stream": chat.stream,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "selfhosted.tier": record.tier,
            "selfhosted.org_id": record.org_id,
            "selfhosted.status": record.status.value,
            "selfhosted.backend": job.model.config.backend,
            "selfhosted.cost_usd": record.cost_usd,
            "selfhosted.usage_source": record.usage_source,
        }
        if chat.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = chat.max_tokens
        if chat.seed is not None:
            attributes["gen_ai.request.seed"] = chat.seed
        if chat.n != 1:
            attributes["gen_ai.request.choice.count"] = chat.n
        if finish is not None:
            attributes["gen_ai.response.finish_reasons"] = [finish.value]
        if record.key_id is not None:
            attributes["selfhosted.key_id"] = record.key_id
        if record.fallback_from is not None:
            attributes["selfhosted.fallback_from"] = record.fallback_from
        for name, value in (("queue_ms", record.queue_ms), ("ttft_ms", record.ttft_ms)):
            if value is not None:
                attributes[f"selfhosted.{name}"] = value
        span = self.tracer.start_span(
            f"{operation} {requested}",
            context=job.trace_parent,
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
            start_time=int(record.created_at * 1e9),
        )
        if job.admitted_s is not None:
            span.add_event("admitted", timestamp=wall_ns(job.admitted_s))
        if job.first_token_s is not None:
            span.add_event("first_token", timestamp=wall_ns(job.first_token_s))
        if record.status is RequestStatus.ERROR:
            span.set_status(trace.Status(trace.StatusCode.ERROR))
        span.end(end_time=int(record.finished_at * 1e9))

    def shutdown(self) -> None:
        """Export what is left (bounded by export_timeout_s), then stop the background thread."""
        self.provider.shutdown()
