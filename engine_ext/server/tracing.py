"""The engine's spans: one per request, a child of the gateway's call (W3C traceparent),
with a child span per Timeline stage and one per KV assembly a reuse method ran.

Spans are built after the request finished, from the timeline the engine thread
stamped (monotonic seconds, mapped to wall-clock time once), so the engine loop never
touches OpenTelemetry. The stage spans up to the first token are contiguous: their
durations add up to the engine's TTFT.

Attribute names, beyond the GenAI conventions (gen_ai.*):
- kvrelay.request.id: the engine's request id
- kvrelay.ttft.<stage>_s: seconds of each stage up to the first token (queue, plan,
  prefill, first); kvrelay.ttft_s: their sum
- kvrelay.prefill.num_steps: engine steps the prefill took (chunks, preemptions)
- kvrelay.reuse.method, kvrelay.reuse.tokens_reused, kvrelay.reuse.tokens_recomputed:
  on each KV assembly span, summed over the request's segments with that method, and on
  a `kvrelay.reuse {method}` event of the prefill span for a method with no placement of
  its own (prefix hits, restored round caches, dense fallbacks)
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping

from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NoOpTracer, Span, SpanKind, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine_ext.engine import RequestOutput
from engine_ext.timeline import Timeline

STAGE_SPANS = {"queue": "kvrelay.queue", "plan": "kvrelay.plan", "prefill": "kvrelay.prefill",
               "first": "kvrelay.first_token", "decode": "kvrelay.decode"}
TTFT_STAGES = ("queue", "plan", "prefill", "first")
_PROPAGATOR = TraceContextTextMapPropagator()


def engine_tracer(provider: TracerProvider | None) -> Tracer:
    return provider.get_tracer("kvrelay.engine") if provider is not None else NoOpTracer()


def emit_request_spans(tracer: Tracer, headers: Mapping[str, str], operation: str, model: str,
                       last: RequestOutput) -> None:
    """The finished request's spans, under the caller's trace when it sent a traceparent."""
    line = last.timeline
    if line is None or line.finished is None or isinstance(tracer, NoOpTracer):
        return
    offset_ns = time.time_ns() - time.monotonic_ns()

    def at(t: float) -> int:
        return int(t * 1e9) + offset_ns

    stages = line.stages()
    root = tracer.start_span(f"{operation} {model}", context=_PROPAGATOR.extract(headers), kind=SpanKind.SERVER,
                             start_time=at(line.arrived))
    root.set_attributes({
        "gen_ai.operation.name": operation, "gen_ai.provider.name": "kvrelay", "gen_ai.request.model": model,
        "gen_ai.usage.input_tokens": last.num_prompt_tokens, "gen_ai.usage.output_tokens": last.num_output_tokens,
        "gen_ai.usage.cache_read.input_tokens": last.num_cached_tokens,
        "gen_ai.response.finish_reasons": [last.finish_reason or ""],
        "kvrelay.request.id": last.request_id, "kvrelay.prefill.num_steps": line.num_prefill_steps,
        **{f"kvrelay.ttft.{name}_s": stages[name].seconds for name in TTFT_STAGES if name in stages},
    })
    if line.ttft is not None:
        root.set_attribute("kvrelay.ttft_s", line.ttft)
        root.set_attribute("gen_ai.response.time_to_first_chunk", line.ttft)
    parent = set_span_in_context(root)
    for name, interval in stages.items():
        span = tracer.start_span(STAGE_SPANS[name], context=parent, start_time=at(interval.start))
        if name == "prefill":
            _assembly_spans(tracer, set_span_in_context(span), span, line, last, at)
        span.end(end_time=at(interval.end))
    root.end(end_time=at(line.finished))


def _assembly_spans(tracer: Tracer, parent: Context, prefill: Span, line: Timeline, last: RequestOutput,
                    at: Callable[[float], int]) -> None:
    """One span per KV placement, with what its method reused and recomputed overall;
    a method that placed nothing itself (prefix hits, restored round caches, dense
    fallbacks) is an event on the prefill span instead."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for outcome in last.reuse_outcomes or []:
        totals[outcome.method][0] += outcome.num_reused
        totals[outcome.method][1] += outcome.num_recomputed
    for method, (reused, recomputed) in totals.items():
        if method not in line.assembly:
            prefill.add_event(f"kvrelay.reuse {method}", {"kvrelay.reuse.method": method,
                                                          "kvrelay.reuse.tokens_reused": reused,
                                                          "kvrelay.reuse.tokens_recomputed": recomputed},
                              timestamp=at(line.planned or line.arrived))
    for method, intervals in line.assembly.items():
        reused, recomputed = totals.get(method, (0, 0))
        for interval in intervals:
            span = tracer.start_span(f"kvrelay.kv_assembly {method}", context=parent, start_time=at(interval.start))
            span.set_attributes({"kvrelay.reuse.method": method, "kvrelay.reuse.tokens_reused": reused,
                                 "kvrelay.reuse.tokens_recomputed": recomputed})
            span.end(end_time=at(interval.end))
