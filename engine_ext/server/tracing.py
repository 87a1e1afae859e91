"""The engine's spans: one per request, a child of the gateway's call (W3C traceparent),
with a child span per Timeline stage, per prefill step and per KV placement; the span
and attribute names are listed in kvrelay/wire/trace_names.py.

Spans are built after the request finished (or failed), from the timeline the engine
thread stamped (monotonic seconds, mapped to wall-clock time once), so the engine loop
never touches OpenTelemetry.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NoOpTracer, Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine_ext.engine import RequestOutput
from engine_ext.timeline import TTFT_STAGES, Timeline
from kvrelay.wire.trace_names import ASSEMBLY_SPAN, PREFILL_STEP_SPAN, REUSE_EVENT, STAGE_SPANS

_PROPAGATOR = TraceContextTextMapPropagator()


def engine_tracer(provider: TracerProvider | None) -> Tracer:
    return provider.get_tracer("kvrelay.engine") if provider is not None else NoOpTracer()


def emit_request_spans(tracer: Tracer, headers: Mapping[str, str], operation: str, model: str,
                       line: Timeline, last: RequestOutput | None, error: str | None = None) -> None:
    """The request's spans, under the caller's trace when it sent a traceparent. `last`
    is its final output (None if it produced none); `error` marks a failed request,
    whose spans end where its timeline stopped (now, if the engine never finished it)."""
    if isinstance(tracer, NoOpTracer):
        return
    offset_ns = time.time_ns() - time.monotonic_ns()

    def at(t: float) -> int:
        return int(t * 1e9) + offset_ns

    if error is not None:  # the engine thread may still be stamping an abandoned request
        line = line.snapshot()
    end = line.finished if line.finished is not None else time.monotonic()
    stages = line.stages(until=end if error is not None else None)
    root = tracer.start_span(f"{operation} {model}", context=_PROPAGATOR.extract(headers), kind=SpanKind.SERVER,
                             start_time=at(line.arrived))
    root.set_attributes({
        "gen_ai.operation.name": operation, "gen_ai.provider.name": "kvrelay", "gen_ai.request.model": model,
        "kvrelay.prefill.num_steps": line.num_prefill_steps,
        **{f"kvrelay.ttft.{name}_s": stages[name].seconds for name in TTFT_STAGES if name in stages},
    })
    if last is not None:
        root.set_attributes({
            "gen_ai.usage.input_tokens": last.num_prompt_tokens, "gen_ai.usage.output_tokens": last.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": last.num_cached_tokens,
            "gen_ai.response.finish_reasons": [last.finish_reason or ""], "gen_ai.response.id": last.request_id})
    if line.ttft is not None:
        root.set_attribute("kvrelay.ttft_s", line.ttft)
    if "prefill" in stages:
        root.set_attribute("kvrelay.prefill.compute_s", line.prefill_compute_s())
        root.set_attribute("kvrelay.prefill.wait_s", line.prefill_wait_s(stages["prefill"]))
    if error is not None:
        root.set_status(Status(StatusCode.ERROR, error))
        root.set_attribute("error.type", error)
    parent = set_span_in_context(root)
    for name, interval in stages.items():
        span = tracer.start_span(STAGE_SPANS[name], context=parent, start_time=at(interval.start))
        if name == "prefill":
            _prefill_children(tracer, span, line, last, at)
        span.end(end_time=at(interval.end))
    root.end(end_time=at(end))


def _prefill_children(tracer: Tracer, prefill: Span, line: Timeline, last: RequestOutput | None,
                      at: Callable[[float], int]) -> None:
    """A span per step that computed a prompt chunk and per KV placement (inside the
    step it happened in, else under the prefill), and per method one event with the
    tokens it reused and recomputed over the whole request."""
    context = set_span_in_context(prefill)
    steps = []
    for step in line.prefill_steps:
        span = tracer.start_span(PREFILL_STEP_SPAN, context=context, start_time=at(step.start))
        steps.append((step, span))
    for method, placements in line.assembly.items():
        for placement in placements:
            holder = next((span for step, span in steps if step.holds(placement)), prefill)
            span = tracer.start_span(f"{ASSEMBLY_SPAN} {method}", context=set_span_in_context(holder),
                                     start_time=at(placement.start))
            span.set_attributes({"kvrelay.reuse.method": method, "kvrelay.reuse.tokens_placed": placement.num_tokens})
            span.end(end_time=at(placement.end))
    for step, span in steps:
        span.end(end_time=at(step.end))
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for outcome in (last.reuse_outcomes if last is not None else None) or []:
        totals[outcome.method][0] += outcome.num_reused
        totals[outcome.method][1] += outcome.num_recomputed
    for method, (reused, recomputed) in totals.items():
        prefill.add_event(f"{REUSE_EVENT} {method}", {"kvrelay.reuse.method": method,
                                                      "kvrelay.reuse.tokens_reused": reused,
                                                      "kvrelay.reuse.tokens_recomputed": recomputed},
                          timestamp=at(line.prefilled or line.planned or line.arrived))
