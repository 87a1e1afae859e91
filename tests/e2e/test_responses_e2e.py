"""The official `openai` client's Responses API through the gateway: to the embedded
engine (tiny random Llama) for records, streams passed through event by event and
previous_response_id chains whose plans the engine shifts; to a fake upstream for
sessions linked through a function call's call_id, unary and streamed."""

from __future__ import annotations

import hashlib
import json

import openai
import pytest

from kvrelay.wire.plan import PLAN_KEY, SegmentPlan
from tests.helpers import make_engine

MODEL = "tiny-llama"
GEN = {"max_output_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
PRIVATE = ("kvrelay", "kvrelay_seal", "kvrelay_ttft")


@pytest.fixture(scope="module")
def srv(llama_dir, run_server):
    with run_server(make_engine(llama_dir, num_blocks=32, name=MODEL), MODEL) as server:
        yield server


@pytest.fixture
def gw(srv, start_gateway):
    gateway = start_gateway([srv.base_url], store_content=True)
    yield gateway
    assert srv.wait_idle(10), "a request left work or KV blocks behind in the engine"


@pytest.fixture
def client(gw):
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_unary_and_streamed_responses_are_recorded_as_their_chat_view(gw, client, srv):
    unary = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello, who are you?", **GEN)
    assert unary.output_text and unary.usage.output_tokens == 8 and unary.status == "incomplete"
    events = list(client.responses.create(model=MODEL, instructions="Be brief.", input="Hello, who are you?",
                                          stream=True, **GEN))
    final = events[-1].response
    assert final.output_text == unary.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for response in (unary, final):  # the engine's reports pass, the plan, seal and TTFT breakdown do not
        params = response.model_extra.get("kv_transfer_params") or {}
        assert not set(params) & set(PRIVATE), params

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]
    prompt = json.dumps(messages, sort_keys=True, ensure_ascii=False)
    rows = gw.rows(2)
    for row, stream in zip(rows, (False, True), strict=True):
        assert (row.status, row.http_status, row.stream) == ("ok", 200, stream)
        assert (row.endpoint, row.model, row.upstream) == ("/v1/responses", MODEL, srv.base_url)
        assert (row.prompt_tokens, row.completion_tokens) == (unary.usage.input_tokens, 8)
        assert row.prompt_text == prompt and row.prompt_sha256 == hashlib.sha256(prompt.encode()).hexdigest()
        assert row.completion_text == unary.output_text
        assert row.ttft_breakdown is not None
        plan = SegmentPlan.model_validate_json(row.plan)
        assert plan.segments and {s.message_index for s in plan.segments} <= {0, 1}
    assert rows[0].ttft_ms is None and 0 < rows[1].ttft_ms <= rows[1].latency_ms
    assert rows[0].session_id is not None


def test_the_event_stream_passes_through_byte_for_byte_in_shape(gw, srv):
    body = {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    with gw.client() as http, http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = [e for e in raw.decode().split("\n\n") if e]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    datas = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    assert names == [d["type"] for d in datas]  # every event keeps its `event:` line, the final one too
    assert names[0] == "response.created" and names[-1] == "response.incomplete"
    assert "[DONE]" not in raw.decode()
    assert not set(datas[-1]["response"].get("kv_transfer_params", {})) & set(PRIVATE)


def test_a_chain_through_the_gateway_has_its_plan_shifted_past_the_history(gw, client):
    first = client.responses.create(model=MODEL, instructions="You are terse.", input="Name a colour.", **GEN)
    second = client.responses.create(model=MODEL, instructions="You are terse.", previous_response_id=first.id,
                                     input="And a fruit?", **GEN)
    report = second.model_extra["kv_transfer_params"]["kvrelay_reuse"]
    assert report["segments"] and "alignment" not in report, report  # every planned segment found its text
    rows = gw.rows(2)
    assert json.loads(rows[1].prompt_text) == [{"role": "system", "content": "You are terse."},
                                               {"role": "user", "content": "And a fruit?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_continuation_by_previous_response_id_stays_in_the_responses_session(gw, client, stream):
    """`input: "go on"` links to nothing by content: the response id names its session
    (and so its engine, which holds the history)."""
    def ask(**fields):
        if not stream:
            return client.responses.create(model=MODEL, **fields, **GEN)
        return list(client.responses.create(model=MODEL, stream=True, **fields, **GEN))[-1].response

    first = ask(input="Tell me a long story about a lighthouse keeper.")
    ask(input="go on", previous_response_id=first.id)
    ask(input="go on")  # the same words without the id: a session of its own
    rows = gw.rows(3)
    assert rows[0].session_id == rows[1].session_id != rows[2].session_id


def test_an_engine_refusal_reaches_the_client_with_its_param(gw, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/cat.png"}]}])
    assert err.value.body["param"] == "input[0].content[0]"
    (row,) = gw.rows(1)
    assert (row.status, row.http_status) == ("client_error", 400)


def test_a_malformed_body_is_refused_at_the_gateway(gw):
    with gw.client() as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = http.post("/v1/responses", json={"model": MODEL, "input": [{"type": "function_call", "name": "f"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].call_id"
    assert all(row.upstream is None for row in gw.rows(2))


# -- sessions linked through call ids (a fake upstream that calls tools) -----------------------
CALL = {"id": "call_weather_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}


def _continue_after(call_id: str) -> list[dict]:
    return [{"role": "user", "content": "What is the weather in Oslo?"},
            {"type": "function_call", "call_id": call_id, "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
            {"type": "function_call_output", "call_id": call_id, "output": [{"type": "input_text", "text": "rain"}]}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_output_links_the_next_call_to_the_session(fake_upstream, start_gateway, stream):
    fake = fake_upstream(models=["fake"], tool_calls=[CALL])
    gw = start_gateway([fake.url])
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=30) as client:
        if stream:
            events = list(client.responses.create(model="fake", input="Weather in Oslo, please.", tools=tools,
                                                  stream=True))
            first = events[-1].response
            assert [e.type for e in events].count("response.function_call_arguments.delta") == 1
        else:
            first = client.responses.create(model="fake", input="Weather in Oslo, please.", tools=tools)
        [call] = [item for item in first.output if item.type == "function_call"]
        assert call.call_id == CALL["id"]
        fake.behaviour.tool_calls = []
        client.responses.create(model="fake", input=_continue_after(call.call_id), tools=tools)
        client.responses.create(model="fake", input="Something else entirely: a haiku about tea.")
    rows = gw.rows(3)
    assert rows[0].session_id == rows[1].session_id != rows[2].session_id
    sent = fake.received[1].body  # the body goes upstream as the client sent it, with the gateway's plan
    assert sent["input"][2]["type"] == "function_call_output" and "messages" not in sent
    plan = SegmentPlan.model_validate(sent["kv_transfer_params"][PLAN_KEY])
    assert plan.session_id == rows[0].session_id
    assert {s.message_index for s in plan.segments} <= {0, 1, 2}  # user, assistant call, tool output


def test_the_fake_s_echoed_plan_never_reaches_the_client(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream(models=["fake"]).url])
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=30) as client:
        unary = client.responses.create(model="fake", input="Hi", extra_body={"kv_transfer_params": {"mine": 1}})
        events = list(client.responses.create(model="fake", input="Hi", stream=True,
                                              extra_body={"kv_transfer_params": {"mine": 2}}))
    assert unary.model_extra["kv_transfer_params"] == {"mine": 1}
    assert events[-1].response.model_extra["kv_transfer_params"] == {"mine": 2}
    assert unary.output_text == events[-1].response.output_text == "Hello world"
    rows = gw.rows(2)
    assert [(r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in rows] == [(7, 4, 3)] * 2
    assert rows[1].ttft_ms is not None


def test_the_gateway_documents_the_route(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream(models=["fake"]).url])
    with gw.client() as http:
        doc = http.get("/openapi.json").json()
    operation = doc["paths"]["/v1/responses"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["required"]) == {"model", "input"} and "previous_response_id" in schema["properties"]
    assert {"200", "400", "502", "504"} <= set(operation["responses"])
