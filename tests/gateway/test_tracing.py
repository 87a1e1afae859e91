"""OpenTelemetry: GenAI spans per call, W3C propagation to the upstream, OTEL_* exporters."""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvrelay.gateway import GatewaySettings, create_app
from kvrelay.gateway.tracing import TracingConfigError, build_tracer_provider
from tests.gateway.support import LoopbackServer

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(spans) -> TracerProvider:
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(spans))
    return p


def _one_span(spans: InMemorySpanExporter, timeout: float = 5.0) -> ReadableSpan:
    deadline = time.monotonic() + timeout
    while not spans.get_finished_spans() and time.monotonic() < deadline:
        time.sleep(0.02)
    finished = spans.get_finished_spans()
    assert len(finished) == 1, [s.name for s in finished]
    return finished[0]


def test_unary_call_is_one_genai_span_with_the_records_facts(fake_upstream, start_gateway, provider, spans):
    up = fake_upstream()
    gw = start_gateway([up.url], tracer_provider=provider)
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 9, "temperature": 0.5},
                   headers={"x-kvrelay-session-id": "s-1", "x-kvrelay-agent-id": "planner"})
    assert r.status_code == 200
    span = _one_span(spans)
    row = gw.rows(1)[0]
    a = span.attributes
    assert span.name == "chat fake" and span.kind is SpanKind.CLIENT
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "kvrelay"
    assert a["gen_ai.request.model"] == "fake"
    assert a["gen_ai.request.max_tokens"] == 9 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.conversation.id"] == "s-1" and a["gen_ai.agent.id"] == "planner"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (7, 4)
    assert a["gen_ai.usage.cache_read.input_tokens"] == 3
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == up.server.port
    assert a["kvrelay.request.id"] == row.id and a["kvrelay.status"] == "ok"
    assert a["kvrelay.stream"] is False
    assert "error.type" not in a and span.status.status_code is StatusCode.UNSET


def test_an_agent_named_by_the_traffic_carries_its_name_on_its_spans(fake_upstream, start_gateway, provider,
                                                                      spans):
    """AutoGen quotes an agent's answer under the agent's `name`: the gateway learns it."""
    answer = "Day one: the castle and Alfama. Day two: Belem and its tower. Day three: the tile museum."
    up = fake_upstream(pieces=[answer])
    gw = start_gateway([up.url], tracer_provider=provider)
    planner = {"role": "system", "content": "You are the planner. Break the task into concrete steps."}
    writer = {"role": "system", "content": "You are the writer. Turn the plan into a friendly answer."}
    task = {"role": "user", "name": "user", "content": "Plan three days in Lisbon on a small budget, please."}
    with gw.client() as c:
        for messages in ([planner, task], [writer, task, {"role": "user", "name": "planner", "content": answer}],
                         [planner, task, {"role": "assistant", "content": answer}]):
            assert c.post("/v1/chat/completions", json={"model": "fake", "messages": messages}).status_code == 200
    deadline = time.monotonic() + 5
    while len(spans.get_finished_spans()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    first, _, last = spans.get_finished_spans()
    assert "gen_ai.agent.name" not in first.attributes  # not named yet
    assert last.attributes["gen_ai.agent.name"] == "planner"
    assert last.attributes["gen_ai.agent.id"] == first.attributes["gen_ai.agent.id"]


def test_stream_span_has_time_to_first_chunk_and_usage_even_when_stripped(fake_upstream, start_gateway,
                                                                          provider, spans):
    up = fake_upstream(first_content_delay=0.05)
    gw = start_gateway([up.url], tracer_provider=provider)
    with gw.client() as c:
        body = c.post("/v1/completions", json={"model": "fake", "prompt": "x", "stream": True}).text
    assert '"usage"' not in body  # the client did not ask for it
    span = _one_span(spans)
    a = span.attributes
    assert span.name == "text_completion fake" and a["gen_ai.operation.name"] == "text_completion"
    assert 0.05 <= a["gen_ai.response.time_to_first_chunk"] < 5
    assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(gw.rows(1)[0].ttft_ms / 1e3)
    assert a["gen_ai.usage.output_tokens"] == 4 and a["kvrelay.stream"] is True


def test_client_trace_continues_through_the_gateway_to_the_upstream(fake_upstream, start_gateway, provider, spans):
    up = fake_upstream()
    gw = start_gateway([up.url], tracer_provider=provider)
    with gw.client() as c:
        c.post("/v1/chat/completions", json=CHAT, headers={"traceparent": CLIENT_PARENT, "tracestate": "k=v"})
    span = _one_span(spans)
    ctx = span.get_span_context()
    assert format(ctx.trace_id, "032x") == CLIENT_TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    sent = up.received[-1].headers
    version, trace_id, parent_id, flags = sent["traceparent"].split("-")
    assert (trace_id, parent_id) == (CLIENT_TRACE_ID, format(ctx.span_id, "016x"))  # upstream is our child
    assert sent["tracestate"] == "k=v"


def test_a_call_without_client_trace_starts_one_and_propagates_it(fake_upstream, start_gateway, provider, spans):
    up = fake_upstream()
    gw = start_gateway([up.url], tracer_provider=provider)
    with gw.client() as c:
        c.post("/v1/chat/completions", json=CHAT)
    span = _one_span(spans)
    assert span.parent is None
    assert up.received[-1].headers["traceparent"].split("-")[1] == format(span.get_span_context().trace_id, "032x")


def test_upstream_failure_marks_the_span_as_error(fake_upstream, start_gateway, provider, spans):
    up = fake_upstream(status=500)
    gw = start_gateway([up.url], tracer_provider=provider)
    with gw.client() as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 502
    span = _one_span(spans)
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "UpstreamFailedError"
    assert span.attributes["http.response.status_code"] == 502


def test_bad_request_is_traced_without_a_model_name(fake_upstream, start_gateway, provider, spans):
    gw = start_gateway([fake_upstream().url], tracer_provider=provider)
    with gw.client() as c:
        assert c.post("/v1/chat/completions", content=b"{nope").status_code == 400
    span = _one_span(spans)
    assert span.name == "chat" and span.attributes["error.type"] == "BadRequestError"


def test_without_exporters_the_clients_trace_context_passes_through_untouched(fake_upstream, start_gateway):
    up = fake_upstream()
    gw = start_gateway([up.url])  # clean_env: no OTEL_* variables, so no provider
    with gw.client() as c:
        c.post("/v1/chat/completions", json=CHAT, headers={"traceparent": CLIENT_PARENT})
    assert up.received[-1].headers["traceparent"] == CLIENT_PARENT


# -- exporters from OTEL_* ------------------------------------------------------------------
def _exporters(provider: TracerProvider) -> list[object]:
    return [p.span_exporter for p in provider._active_span_processor._span_processors]


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}, None),
    ({"OTEL_TRACES_EXPORTER": "none"}, None),
    ({"OTEL_TRACES_EXPORTER": "console"}, [ConsoleSpanExporter]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, [HttpExporter]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, [GrpcExporter]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
      "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, [HttpExporter, ConsoleSpanExporter]),
])
def test_exporters_follow_the_otel_variables(env, expected):
    provider = build_tracer_provider(env)
    if expected is None:
        assert provider is None
        return
    try:
        assert [type(e) for e in _exporters(provider)] == expected
    finally:
        provider.shutdown()


def test_service_name_comes_from_otel_service_name():
    provider = build_tracer_provider({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "edge-1"})
    try:
        assert provider.resource.attributes["service.name"] == "edge-1"
    finally:
        provider.shutdown()


@pytest.mark.parametrize("env, words", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "unknown exporter 'zipkin'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "'http/json'"),
])
def test_unsupported_exporters_are_refused_clearly(env, words):
    with pytest.raises(TracingConfigError, match=words):
        build_tracer_provider(env)


# -- end to end through a real OTLP/HTTP receiver ----------------------------------------------
class OtlpReceiver:
    """A minimal OTLP/HTTP trace receiver: decodes each protobuf export it is sent."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.server = LoopbackServer(Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])]))

    async def _traces(self, request: Request) -> Response:
        assert request.headers["content-type"] == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.body())
        self.requests.append(message)
        return Response(ExportTraceServiceRequest().SerializeToString(), media_type="application/x-protobuf")

    def spans(self) -> list[tuple[str, dict[str, object], dict[str, object]]]:
        """(span name, attributes, resource attributes) of everything received."""
        out = []
        for message in self.requests:
            for resource_spans in message.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        out.append((span.name, {kv.key: _value(kv.value) for kv in span.attributes}, resource))
        return out


def _value(any_value) -> object:
    return getattr(any_value, any_value.WhichOneof("value"))


def test_spans_reach_an_otlp_http_receiver(fake_upstream, tmp_path, clean_env, _servers):
    receiver = OtlpReceiver()
    _servers.append(receiver.server)
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.server.url + "/v1/traces")
    clean_env.setenv("OTEL_SERVICE_NAME", "kvrelay-test")
    up = fake_upstream()
    settings = GatewaySettings(upstreams=[up.url], database_url=f"sqlite+aiosqlite:///{tmp_path / 'g.sqlite'}")
    gateway = LoopbackServer(create_app(settings))  # builds its own provider from the environment
    _servers.append(gateway)
    import httpx

    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        assert c.post("/v1/chat/completions", json=CHAT, headers={"x-kvrelay-session-id": "s-9"}).status_code == 200
    gateway.stop()  # shutdown flushes the batch processor
    [(name, attributes, resource)] = receiver.spans()
    assert name == "chat fake" and resource["service.name"] == "kvrelay-test"
    assert attributes["gen_ai.conversation.id"] == "s-9" and attributes["gen_ai.usage.input_tokens"] == 7


def test_the_gateway_s_call_and_the_engine_s_request_are_one_trace(llama_dir, run_server, start_gateway,
                                                                   provider, spans):
    from tests.helpers import make_engine, undocumented_names

    engine_spans = InMemorySpanExporter()
    engine_provider = TracerProvider()
    engine_provider.add_span_processor(SimpleSpanProcessor(engine_spans))
    llm = make_engine(llama_dir, 64, name="tiny")
    with run_server(llm, "tiny", engine_provider) as srv:
        gw = start_gateway([srv.base_url], tracer_provider=provider)
        with gw.client() as c:
            r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Hi there."}]},
                       headers={"traceparent": CLIENT_PARENT})
        assert r.status_code == 200
        call = _one_span(spans)
        deadline = time.monotonic() + 5
        while not any(s.name == "chat tiny" for s in engine_spans.get_finished_spans()) and time.monotonic() < deadline:
            time.sleep(0.02)
    engine_root = next(s for s in engine_spans.get_finished_spans() if s.name == "chat tiny")
    assert format(engine_root.context.trace_id, "032x") == CLIENT_TRACE_ID == format(call.context.trace_id, "032x")
    assert engine_root.parent.span_id == call.context.span_id
    assert call.start_time <= engine_root.start_time and engine_root.end_time <= call.end_time
    children = {s.name for s in engine_spans.get_finished_spans()
                if s.parent is not None and s.parent.span_id == engine_root.context.span_id}
    assert {"kvrelay.queue", "kvrelay.plan", "kvrelay.prefill", "kvrelay.first_token", "kvrelay.decode"} <= children
    assert not undocumented_names([call, *engine_spans.get_finished_spans()])  # kvrelay/wire/trace_names.py lists all
