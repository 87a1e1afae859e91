"""OpenTelemetry: one GenAI span per proxied call, exporters chosen by the OTEL_* variables.

The tracer provider belongs to the app (never the process-global one), so two gateways
in one process, or a test with an in-memory exporter, do not share spans. Exporters
come from the OTEL_* variables, read the same way for the engine (kvrelay/wire/otel.py);
span and attribute names are listed in kvrelay/wire/trace_names.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import (INVALID_SPAN, INVALID_SPAN_CONTEXT, NoOpTracer, Span, SpanKind, Status, StatusCode, Tracer,
                                 set_span_in_context)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvrelay.wire.otel import TracingConfigError, build_provider  # noqa: F401  (re-exported: the CLI maps it)
from kvrelay.wire.plan import SegmentPlan
from kvrelay.gateway.storage.writer import RequestRecord

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate
_REQUEST_PARAMS = {  # body field -> GenAI attribute
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "seed": "gen_ai.request.seed",
}


def build_tracer_provider(env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """The gateway's provider from the OTEL_* variables (kvrelay.wire.otel), or None."""
    return build_provider(env, default_service="kvrelay-gateway")


def tracer_from(provider: TracerProvider | None) -> Tracer:
    return provider.get_tracer("kvrelay.gateway") if provider is not None else NoOpTracer()


def start_call_span(tracer: Tracer, operation: str, client_headers: Mapping[str, str]) -> Span:
    """The call's span, a child of the client's trace when it sent a traceparent;
    `operation`: the GenAI operation name of its route (Endpoint.operation). Tracing off
    (a NoOpTracer, the default): the span every NoOpTracer returns, without reading the
    client's trace context first (its traceparent still goes upstream as it came)."""
    if isinstance(tracer, NoOpTracer):
        return INVALID_SPAN
    parent: Context = _PROPAGATOR.extract(client_headers)
    span = tracer.start_span(operation, context=parent, kind=SpanKind.CLIENT)
    if span.is_recording():
        span.set_attribute("gen_ai.operation.name", operation)
        span.set_attribute("gen_ai.provider.name", "kvrelay")
    return span


def describe_request(span: Span, operation: str, body: Mapping[str, Any], model: str) -> None:
    """Name the span `{operation} {model}` and note the sampling parameters asked for."""
    if not span.is_recording():
        return
    span.update_name(f"{operation} {model}")
    span.set_attribute("gen_ai.request.model", model)
    for field, attribute in _REQUEST_PARAMS.items():
        value = body.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            span.set_attribute(attribute, value)


def describe_plan(span: Span, plan: SegmentPlan, session_inferred: bool, agent_name: str | None = None) -> None:
    """What inference found: counts by segment kind, placeholder names, how the session
    was known, and the agent's name when the traffic has given it one."""
    if not span.is_recording():
        return
    kinds = Counter(s.kind for s in plan.segments)
    if agent_name:
        span.set_attribute("gen_ai.agent.name", agent_name)
    span.set_attributes({
        "kvrelay.plan.version": plan.version,
        "kvrelay.plan.num_segments": len(plan.segments),
        **{f"kvrelay.plan.num_{kind}": n for kind, n in kinds.items()},
        "kvrelay.plan.placeholders": [s.name for s in plan.segments if s.kind == "placeholder" and s.name],
        "kvrelay.session.inferred": session_inferred,
    })
    if plan.round is not None:
        span.set_attributes({"kvrelay.round.id": plan.round.id, "kvrelay.round.size": plan.round.size,
                             "kvrelay.round.index": plan.round.index})


def trace_headers(span: Span) -> dict[str, str]:
    """traceparent/tracestate that make the upstream's work a child of this span."""
    carrier: dict[str, str] = {}
    if span.get_span_context() == INVALID_SPAN_CONTEXT:
        return carrier  # what inject would write: nothing (no trace, tracing off)
    _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    return carrier


def end_call_span(span: Span, record: RequestRecord, finish_reasons: list[str]) -> None:
    """Everything the record knows, as GenAI and kvrelay.* attributes; then end the span."""
    if span.is_recording():
        attributes: dict[str, Any] = {
            "gen_ai.conversation.id": record.session_id,
            "gen_ai.agent.id": record.agent_id,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
            "gen_ai.response.time_to_first_chunk": record.ttft_ms / 1e3 if record.ttft_ms is not None else None,
            "gen_ai.response.finish_reasons": finish_reasons or None,
            "http.response.status_code": record.http_status,
            "kvrelay.request.id": record.id,
            "kvrelay.stream": record.stream,
            "kvrelay.status": record.status,
            "kvrelay.upstream": record.upstream,
            "kvrelay.prompt.sha256": record.prompt_sha256,
        }
        if record.upstream is not None:
            url = urlsplit(record.upstream)
            attributes["server.address"] = url.hostname
            attributes["server.port"] = url.port or (443 if url.scheme == "https" else 80)
        if record.status != "ok":
            attributes["error.type"] = record.error_type or record.status
            span.set_status(Status(StatusCode.ERROR, record.error_type or record.status))
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    span.end()
