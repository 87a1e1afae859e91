"""The engine's Responses API end to end on loopback, with the tiny Llama, through the
official `openai` client: unary and streamed responses agree with chat completions on
the same messages, the stream helper, instructions, previous_response_id chains (and
their 400s), max_output_tokens -> incomplete, refusals naming the field, a gateway plan
shifted past the inserted history (sealed or not), and the response store's bounds."""

from __future__ import annotations

import hashlib
import json

import httpx
import openai
import pytest

from kvrelay.wire.seal import PlanSeal
from kvrelay.wire.plan import PLAN_KEY, Segment, SegmentPlan
from engine_ext.server.plans import MessageShift, PlanReader
from engine_ext.server.responses import ResponseStore
from tests.helpers import make_engine, slow_with_abort_spy

MODEL = "tiny-llama"
GEN = {"max_output_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
SECRET = "responses-test-secret-0123456789"


@pytest.fixture(scope="module")
def srv(llama_dir, run_server):
    with run_server(make_engine(llama_dir, num_blocks=32, name=MODEL), MODEL) as server:
        yield server


@pytest.fixture(autouse=True)
def _idle_between_tests(request):
    yield
    if "srv" in request.fixturenames:
        assert request.getfixturevalue("srv").wait_idle(10), "a test left work or KV blocks behind"


@pytest.fixture
def client(srv):
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int = 8, **extra) -> tuple[str, object]:
    """The chat completions answer for the same messages: the oracle."""
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True, **extra})
    return resp.choices[0].message.content, resp.usage


# -- unary and streamed --------------------------------------------------------------------
def test_a_response_is_the_chat_answer_in_the_responses_shape(client):
    resp = client.responses.create(model=MODEL, input="What is the capital of France?", **GEN)
    text, usage = chat_text(client, [{"role": "user", "content": "What is the capital of France?"}])
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.output_text == text and text
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    [message] = resp.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.status == "incomplete"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (usage.prompt_tokens, 8)
    assert resp.usage.total_tokens == usage.prompt_tokens + 8
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    assert resp.max_output_tokens == 8 and resp.temperature == 0 and resp.store is True
    assert resp.tools == [] and resp.tool_choice == "auto" and resp.parallel_tool_calls is True


def test_a_stop_makes_a_completed_response_with_the_echoed_settings(client):
    full, _ = chat_text(client, [{"role": "user", "content": "Say something."}], max_tokens=24)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    resp = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Say something."}],
                                   max_output_tokens=24, temperature=0, top_p=0.5, metadata={"k": "v"},
                                   text={"format": {"type": "text"}}, user="u-1",
                                   extra_body={"ignore_eos": True, "stop": stop})
    assert resp.status == "completed" and resp.incomplete_details is None and resp.completed_at
    assert resp.output_text == full[: full.index(stop)]
    assert (resp.top_p, resp.metadata, resp.user, resp.text.format.type) == (0.5, {"k": "v"}, "u-1", "text")


def test_streamed_events_agree_with_the_unary_response(client):
    unary = client.responses.create(model=MODEL, input="Tell me a story.", **GEN)
    events = list(client.responses.create(model=MODEL, input="Tell me a story.", stream=True, **GEN))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == unary.output_text
    final = events[-1].response
    assert final.output_text == unary.output_text and final.status == "incomplete"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (unary.usage.input_tokens, 8)
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}


def test_the_stream_helper_gives_the_final_response(client):
    full, _ = chat_text(client, [{"role": "user", "content": "Count."}], max_tokens=24)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    with client.responses.stream(model=MODEL, input="Count.", max_output_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True, "stop": stop}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas) == full[: full.index(stop)]


def test_instructions_lead_as_a_system_message(client):
    resp = client.responses.create(model=MODEL, instructions="Answer in French.", input="Hello!", **GEN)
    text, _ = chat_text(client, [{"role": "system", "content": "Answer in French."},
                                 {"role": "user", "content": "Hello!"}])
    assert resp.output_text == text and resp.instructions == "Answer in French."


def test_kv_transfer_params_come_back_as_a_top_level_field(client):
    resp = client.responses.create(model=MODEL, input="Hi", **{**GEN, "extra_body": {
        "ignore_eos": True, "kv_transfer_params": {"mine": 1}}})
    assert resp.model_extra["kv_transfer_params"]["mine"] == 1
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True, **{**GEN, "extra_body": {
        "ignore_eos": True, "kv_transfer_params": {"mine": 2}}}))
    assert events[-1].response.model_extra["kv_transfer_params"]["mine"] == 2


def test_a_client_that_leaves_mid_stream_aborts_the_request(srv, monkeypatch):
    aborted = slow_with_abort_spy(srv.llm, monkeypatch)
    body = {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 300, "temperature": 0,
            "ignore_eos": True}
    seen = 0
    with httpx.Client(base_url=srv.base_url, timeout=30) as http, \
            http.stream("POST", "/v1/responses", json=body) as r:
        for line in r.iter_lines():
            seen += line == "event: response.output_text.delta"
            if seen == 2:
                break
    assert srv.wait_idle(5), "the engine kept generating for a client that left"
    assert len(aborted) == 1


# -- previous_response_id ------------------------------------------------------------------
def test_a_chain_continues_the_stored_conversation_without_the_old_instructions(client):
    first = client.responses.create(model=MODEL, instructions="Be terse.", input="Name a colour.", **GEN)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="Another one?", **GEN)
    history = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text}]
    text, usage = chat_text(client, [*history, {"role": "user", "content": "Another one?"}])
    assert second.output_text == text and second.previous_response_id == first.id
    assert second.usage.input_tokens == usage.prompt_tokens
    # a third turn, streamed, with new instructions: they lead, the history follows
    events = list(client.responses.create(model=MODEL, previous_response_id=second.id, instructions="Be kind.",
                                          input=[{"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Last one."}]}],
                                          stream=True, **GEN))
    third = events[-1].response
    text, _ = chat_text(client, [{"role": "system", "content": "Be kind."}, *history,
                                 {"role": "user", "content": "Another one?"},
                                 {"role": "assistant", "content": second.output_text},
                                 {"role": "user", "content": "Last one."}])
    assert third.output_text == text
    # and the streamed one is stored too
    fourth = client.responses.create(model=MODEL, previous_response_id=third.id, input="Done?", **GEN)
    assert fourth.status == "incomplete" and fourth.output_text


def test_unknown_and_unstored_previous_responses_are_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, previous_response_id="resp_nope", input="Hi", **GEN)
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["message"] == "Previous response with id 'resp_nope' not found."
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, **GEN)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, previous_response_id=unstored.id, input="Hi", **GEN)
    assert err.value.body["param"] == "previous_response_id"


# -- refusals ------------------------------------------------------------------------------
IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, IMAGE]}]}, "input[0].content[1]"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_1"}]}, "input[1].type"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "web_search"}]}, "tools[1].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include[1]"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": []}, "input"),
])
def test_what_the_engine_cannot_honour_is_a_400_naming_the_field(srv, fields, param):
    body = {"model": MODEL, "input": "Hi", **fields}
    r = httpx.post(f"{srv.v1}/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error


def test_an_unknown_model_is_a_404_and_a_bad_body_a_400(srv):
    r = httpx.post(f"{srv.v1}/responses", json={"model": "nope", "input": "Hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{srv.v1}/responses", content=b"[1]", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(f"{srv.v1}/responses", content=b'{"model": "tiny-llama", "input": "\\ud800"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_accepted_fields_without_effect_do_not_change_the_answer(client):
    plain = client.responses.create(model=MODEL, input="Hi there", **GEN)
    dressed = client.responses.create(model=MODEL, input="Hi there", metadata={"a": "b"}, user="u", store=True,
                                      service_tier="auto", prompt_cache_key="k", safety_identifier="s", include=[],
                                      reasoning={"effort": None}, truncation="disabled", parallel_tool_calls=False,
                                      **GEN)
    assert dressed.output_text == plain.output_text and dressed.parallel_tool_calls is False


# -- plans and the inserted history --------------------------------------------------------
def _plan(messages: list[str]) -> dict:
    segments = [Segment(message_index=i, char_start=0, char_end=len(text), kind="private",
                        content_hash=hashlib.sha256(text.encode()).hexdigest()) for i, text in enumerate(messages)]
    return SegmentPlan(session_id="s", agent_id="a", request_id="r", segments=segments).model_dump(mode="json")


def _continue_with_plan(base_url: str, seal: PlanSeal | None) -> dict:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        first = http.post("/v1/responses", json={"model": MODEL, "input": "Name a colour.", "max_output_tokens": 4,
                                                 "temperature": 0, "ignore_eos": True}).json()
        plan = _plan(["Be terse.", "And a fruit?"])  # the gateway's view: no history
        params = {PLAN_KEY: plan, **({"kvrelay_seal": seal.seal(plan)} if seal else {})}
        r = http.post("/v1/responses", json={"model": MODEL, "instructions": "Be terse.", "input": "And a fruit?",
                                             "previous_response_id": first["id"], "max_output_tokens": 4,
                                             "temperature": 0, "ignore_eos": True, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]["kvrelay_reuse"]


def test_the_plan_is_shifted_past_the_history_it_did_not_see(srv):
    report = _continue_with_plan(srv.base_url, None)
    assert "alignment" not in report, report  # every segment found its text
    assert len(report["segments"]) == 2


def test_a_sealed_plan_is_checked_as_sealed_then_shifted(llama_dir, run_server):
    seal = PlanSeal(SECRET)
    with run_server(make_engine(llama_dir, num_blocks=32, name=MODEL), MODEL, plan_seal=seal) as server:
        report = _continue_with_plan(server.base_url, seal)
        assert "alignment" not in report, report
        assert len(report["segments"]) == 2
        metrics = httpx.get(server.base_url + "/metrics").text
    assert 'reason="forged"} 0' in metrics and 'reason="unsealed"} 0' in metrics


def test_a_message_shift_moves_only_the_later_segments():
    plan = SegmentPlan.model_validate(_plan(["a", "b", "c"]))
    shifted = MessageShift(1, 4).apply(plan)
    assert [s.message_index for s in shifted.segments] == [0, 5, 6]
    assert MessageShift(0, 0).apply(plan) is plan
    reader = PlanReader()
    assert [s.message_index for s in reader.read({PLAN_KEY: _plan(["a", "b", "c"])},
                                                 MessageShift(2, 1)).segments] == [0, 1, 3]
    assert [s.message_index for s in reader.read({PLAN_KEY: _plan(["a", "b", "c"])}).segments] == [0, 1, 2]


# -- the store -----------------------------------------------------------------------------
def test_the_store_keeps_the_last_n_and_forgets_after_its_ttl():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    store.keep("r1", None, [{"role": "user", "content": "1"}])
    store.keep("r2", store.get("r1"), [{"role": "user", "content": "2"}])
    store.keep("r3", store.get("r2"), [{"role": "user", "content": "3"}])
    assert store.get("r1") is None and len(store) == 2  # out of the index; its turn lives on in r2's chain
    assert [m["content"] for m in store.get("r3").conversation()] == ["1", "2", "3"]
    now[0] = 11
    assert store.get("r3") is None


def test_the_store_reads_its_bounds_from_the_environment():
    store = ResponseStore.from_env({"KVRELAY_RESPONSES_MAX_STORED": "5", "KVRELAY_RESPONSES_TTL_S": "60"})
    assert (store.max_entries, store.ttl_s) == (5, 60.0)
    assert (ResponseStore.from_env({}).max_entries, ResponseStore.from_env({}).ttl_s) == (1024, None)
    with pytest.raises(ValueError, match="KVRELAY_RESPONSES_MAX_STORED"):
        ResponseStore.from_env({"KVRELAY_RESPONSES_MAX_STORED": "0"})


def test_the_openapi_document_describes_the_route(srv):
    doc = httpx.get(srv.base_url + "/openapi.json").json()
    schema = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["required"]) == {"model", "input"} and "previous_response_id" in schema["properties"]
    assert json.dumps(doc)  # serialisable
