"""The engine continues the caller's W3C trace: one server span per request with a
child per stage (queue, plan, prefill with its KV assembly, first token, decode). The
stages up to the first token are contiguous and add up to the engine's TTFT, which the
client, one loopback hop away, sees as its own TTFT plus a few milliseconds."""

from __future__ import annotations

import hashlib
import time

import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from engine_ext.config import EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from kvrelay.wire.plan import Segment, SegmentPlan
from engine_ext.timeline import TTFT_STAGES
from tests.helpers import undocumented_names

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
MODEL = "smollm2"


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def srv(smollm2_dir, run_server, spans):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    llm = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=256 * 2**20), model_name=MODEL)
    with run_server(llm, MODEL, provider) as server:
        yield server


def _engine_spans(spans: InMemorySpanExporter, root: str = f"chat {MODEL}",
                  timeout: float = 5.0) -> dict[str, ReadableSpan]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished = {s.name: s for s in spans.get_finished_spans()}
        if root in finished:
            return finished
        time.sleep(0.02)
    raise AssertionError(f"no request span: {[s.name for s in spans.get_finished_spans()]}")


def test_the_stages_add_up_to_the_ttft_the_client_sees(srv, spans):
    prompt = "Tell me about the markets of the old town. " * 40  # ~400 tokens: a TTFT worth measuring
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0) as client:
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=0, stream=True,
            extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        client_ttft = None
        for chunk in stream:
            if client_ttft is None and chunk.choices and chunk.choices[0].delta.content:
                client_ttft = time.perf_counter() - start
    found = _engine_spans(spans)
    root = found[f"chat {MODEL}"]
    assert root.kind is SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == TRACE_ID and format(root.parent.span_id, "016x") == PARENT_ID
    stages = [found[f"kvrelay.{name}"] for name in ("prepare", "queue", "plan", "prefill", "first_token", "decode")]
    assert all(s.parent.span_id == root.context.span_id for s in stages)
    assert all(a.end_time == b.start_time for a, b in zip(stages, stages[1:]))  # contiguous
    assert stages[0].start_time == root.start_time and stages[-1].end_time == root.end_time
    engine_ttft = (stages[4].end_time - stages[0].start_time) / 1e9
    attrs = root.attributes
    assert attrs["kvrelay.ttft_s"] == pytest.approx(engine_ttft, abs=1e-6)
    assert sum(attrs[f"kvrelay.ttft.{name}_s"] for name in TTFT_STAGES) == pytest.approx(engine_ttft, abs=1e-6)
    assert attrs["gen_ai.usage.input_tokens"] > 300 and attrs["gen_ai.usage.output_tokens"] == 6
    # The client's TTFT is the engine's plus the HTTP hop and the first SSE write.
    assert engine_ttft <= client_ttft < engine_ttft + 0.15, (engine_ttft, client_ttft)
    assert stages[3].end_time - stages[3].start_time > 0.5 * (engine_ttft * 1e9)  # the prefill dominates


def test_without_a_traceparent_the_request_starts_a_trace(srv, spans):
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0) as client:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    root = _engine_spans(spans, f"text_completion {MODEL}")[f"text_completion {MODEL}"]
    assert root.parent is None and root.attributes["gen_ai.operation.name"] == "text_completion"



def test_a_caller_with_kv_transfer_params_gets_the_ttft_breakdown(srv):
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0) as client:
        plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0)
        asked = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0,
                                          extra_body={"kv_transfer_params": {}})
        streamed = list(client.completions.create(model=MODEL, prompt="Hello again", max_tokens=2, temperature=0,
                                                  stream=True, extra_body={"kv_transfer_params": {}}))
    assert not (plain.model_extra or {}).get("kv_transfer_params")
    for params in (asked.model_extra["kv_transfer_params"], streamed[-1].model_extra["kv_transfer_params"]):
        report = params["kvrelay_ttft"]
        assert report["ttft_s"] > 0 and report["prefill_steps"] >= 1
        assert sum(report[f"{name}_s"] for name in TTFT_STAGES) == pytest.approx(report["ttft_s"])
        # No plan, nothing reused beyond the prefix cache: the prefix path's own work, saving 0.
        assert report["saved_s"] == 0.0 and report["dense_ttft_s"] == report["ttft_s"]


def test_reuse_methods_show_as_kv_assembly_spans_or_prefill_events(smollm2_dir, run_server, spans):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    llm = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=256 * 2**20, reuse=ReuseConfig(min_segment_tokens=8)),
                    model_name=MODEL)
    doc = "The harbour ledger lists wool, salt and timber shipments for every month of the year. " * 4

    def ask(prefix: str, method: str) -> None:
        text = prefix + doc + "\nWhich shipment was largest?"
        start = len(prefix)
        segments = [Segment(message_index=0, char_start=start, char_end=start + len(doc), kind="shared_block",
                            content_hash=hashlib.sha256(doc.encode()).hexdigest(), method=method)]
        plan = SegmentPlan(session_id="s", agent_id="a", request_id=f"r-{prefix[:3]}", segments=segments)
        with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0) as client:
            client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0,
                                      extra_body={"kv_transfer_params": {"kvrelay": plan.model_dump(mode="json")}})

    with run_server(llm, MODEL, provider) as srv:
        ask("First:\n", "shift")  # the document starts on a token edge: after a newline, not a space
        spans.clear()
        ask("Then again, a longer opening line:\n", "shift")
    found = _engine_spans(spans, f"text_completion {MODEL}")
    assembly, step, prefill = found["kvrelay.kv_assembly shift"], found["kvrelay.prefill_step"], found["kvrelay.prefill"]
    assert assembly.attributes["kvrelay.reuse.method"] == "shift"
    placed = assembly.attributes["kvrelay.reuse.tokens_placed"]
    # The placement ran inside the step that computed the rest of the prompt, inside the prefill.
    assert assembly.parent.span_id == step.context.span_id and step.parent.span_id == prefill.context.span_id
    assert prefill.start_time <= step.start_time <= assembly.start_time <= assembly.end_time <= step.end_time
    assert step.end_time <= prefill.end_time
    # The method's totals are one event, so summing events never double counts.
    (event,) = [e for e in prefill.events if e.name == "kvrelay.reuse shift"]
    assert 0 < event.attributes["kvrelay.reuse.tokens_reused"] <= placed
    assert not undocumented_names(found.values())


def test_the_ttft_header_asks_for_the_breakdown_without_kv_transfer_params(srv):
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0) as client:
        asked = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0,
                                          extra_headers={"x-kvrelay-ttft": "1"})
        declined = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0,
                                             extra_headers={"x-kvrelay-ttft": "off"})
    report = asked.model_extra["kv_transfer_params"]["kvrelay_ttft"]
    assert report["ttft_s"] > 0 and report["prefill_compute_s"] > 0
    assert not (declined.model_extra or {}).get("kv_transfer_params")


def test_an_abandoned_stream_still_gets_its_spans_marked_as_an_error(srv, spans):
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count slowly to one hundred."}], max_tokens=200,
            temperature=0, stream=True, extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break  # the client goes away after its first token
        stream.close()
    found = _engine_spans(spans)
    root = found[f"chat {MODEL}"]
    assert root.status.status_code is StatusCode.ERROR and root.attributes["error.type"] == "cancelled"
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert {"kvrelay.queue", "kvrelay.prefill", "kvrelay.first_token"} <= set(found)
    assert root.attributes["kvrelay.ttft_s"] > 0


def test_a_tracing_failure_never_breaks_the_response(srv, spans, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("exporter exploded")

    monkeypatch.setattr("engine_ext.server.service.emit_request_spans", broken)
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0) as client:
        unary = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
        streamed = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0,
                                                  stream=True))
    assert unary.usage.completion_tokens == 2 and streamed[-1].choices[0].finish_reason == "length"
    assert spans.get_finished_spans() == ()


def test_a_request_abandoned_mid_prefill_ends_its_open_stage_at_the_failure(spans):
    from engine_ext.server.tracing import emit_request_spans
    from engine_ext.timeline import Interval, Placement, Timeline

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    now = time.monotonic()
    line = Timeline(arrived=now - 1.0, queued=now - 0.9, admitted=now - 0.8, planned=now - 0.7)
    line.placed("shift", Placement(now - 0.65, now - 0.6, 32))
    line.prefill_steps.append(Interval(now - 0.6, now - 0.3))  # one chunk done, the next one running
    emit_request_spans(provider.get_tracer("t"), {}, "chat", MODEL, line, None, "cancelled")
    found = {s.name: s for s in spans.get_finished_spans()}
    root, prefill = found[f"chat {MODEL}"], found["kvrelay.prefill"]
    assert root.status.status_code is StatusCode.ERROR and root.attributes["error.type"] == "cancelled"
    assert "kvrelay.first_token" not in found and "kvrelay.ttft_s" not in root.attributes
    assert prefill.end_time == root.end_time and prefill.end_time - prefill.start_time >= 0.7e9
    assert root.attributes["kvrelay.prefill.compute_s"] == pytest.approx(0.3)
    assert found["kvrelay.kv_assembly shift"].parent.span_id == prefill.context.span_id  # at admission


def test_a_timeline_without_a_server_starts_with_its_queue():
    from engine_ext.timeline import Timeline

    line = Timeline(arrived=1.0, admitted=2.0, planned=2.5)
    assert list(line.stages()) == ["queue", "plan"]
    assert line.stages(until=4.0)["prefill"] == (2.5, 4.0)
    assert line.stages(until=2.0) == line.stages()  # a failure before the open stage began adds nothing
