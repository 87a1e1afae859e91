"""The gateway's reading of Responses API calls, without servers: the chat-shaped view
of a body, the facts of a Response, its stream events as kvrelay/gateway/sse.py inspects them,
what is hidden from the client, and the gateway's own error event."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.gateway.engine_params import event_without_params
from kvrelay.gateway.errors import BadRequestError
from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference.messages import call_ids, prompt_messages
from kvrelay.gateway.endpoints.responses import answer_facts, chat_view, error_event
from kvrelay.gateway.sse import inspect

BODY = {"model": "m", "instructions": "Sys.", "prompt_cache_key": "sess-9", "metadata": {"agent_id": "coder"},
        "input": [{"role": "user", "content": "Weather?"},
                  {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "rain"},
                  {"type": "reasoning", "id": "rs_1", "summary": []}],
        "max_output_tokens": 5}


def event(kind: str, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def test_the_view_is_the_chat_body_planning_and_identity_read():
    view = chat_view(BODY)
    assert [m.role for m in prompt_messages(view)] == ["system", "user", "assistant", "tool"]
    assert call_ids(view) == ["c1", "c1"]
    assert view["max_completion_tokens"] == 5 and "input" not in view and "instructions" not in view
    ident = identify({}, view)
    assert (ident.session_id, ident.agent_id) == ("sess-9", "coder")
    with pytest.raises(BadRequestError) as err:
        chat_view({"model": "m", "input": [{"role": "user", "content": 5}]})
    assert err.value.param == "input[0].content"


def test_a_response_s_facts():
    response = {"status": "completed", "usage": {"input_tokens": 9, "output_tokens": 3,
                                                 "input_tokens_details": {"cached_tokens": 4}},
                "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi"}]},
                           {"type": "function_call", "call_id": "c7", "name": "f", "arguments": "{}"}]}
    facts = answer_facts(response)
    assert (facts.text, facts.call_ids, facts.finish_reasons) == ("Hi", ("c7",), ("tool_calls",))
    assert facts.usage == {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
    cut = answer_facts({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}, "output": 3})
    assert (cut.text, cut.finish_reasons, cut.usage) == ("", ("length",), None)


def test_stream_events_as_the_gateway_inspects_them():
    delta = inspect(event("response.output_text.delta", sequence_number=4, delta="Hel"))
    assert (delta.has_content, delta.text, delta.sequence_number) == (True, "Hel", 4)
    added = inspect(event("response.output_item.added", sequence_number=5,
                          item={"type": "function_call", "call_id": "c1", "name": "f", "arguments": ""}))
    assert (added.has_content, added.tool_call_ids) == (True, ("c1",))
    message = inspect(event("response.output_item.added", item={"type": "message", "content": []}))
    assert not message.has_content and message.tool_call_ids == ()
    done = inspect(event("response.completed", sequence_number=9, response={
        "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
        "usage": {"input_tokens": 2, "output_tokens": 1}, "kv_transfer_params": {"kvrelay_ttft": {}}}))
    assert done.terminal and done.finish_reasons == ("length",) and done.usage["prompt_tokens"] == 2
    assert done.kv_transfer_params == {"kvrelay_ttft": {}} and not done.is_usage_only
    failed = inspect(event("response.failed", response={"status": "failed", "error": {"message": "x"}}))
    assert failed.terminal and failed.error == {"message": "x"}
    error = inspect(event("error", message="boom", code="server_error"))
    assert error.error["message"] == "boom" and not error.terminal


def test_hidden_params_leave_the_final_response_and_the_event_keeps_its_name():
    raw = event("response.completed", sequence_number=3, response={"id": "resp_1", "kv_transfer_params": {
        "kvrelay": {}, "kvrelay_seal": {}, "kvrelay_reuse": {"segments": []}}})
    out = event_without_params(raw, ("kvrelay", "kvrelay_seal"))
    name, data = out.decode().removesuffix("\n\n").split("\n")
    assert name == "event: response.completed"
    body = json.loads(data.removeprefix("data: "))
    assert body["response"]["kv_transfer_params"] == {"kvrelay_reuse": {"segments": []}}
    assert body["sequence_number"] == 3
    only_hidden = event("response.completed", response={"id": "r", "kv_transfer_params": {"kvrelay": {}}})
    assert "kv_transfer_params" not in json.loads(event_without_params(only_hidden, ("kvrelay",)).split(b"data: ")[1])[
        "response"]


def test_a_final_chunk_with_a_lone_surrogate_escape_is_still_re_encoded():
    """An engine's text may end mid-pair (`\\ud83d`): the chunk that carries its reports is
    written again without them, the escape kept, not refused."""
    raw = (b'data: {"choices":[{"index":0,"delta":{"content":"x\\ud83d"},"finish_reason":"stop"}],'
           b'"kv_transfer_params":{"kvrelay":{},"kvrelay_ttft":{}}}\n\n')
    out = event_without_params(raw, ("kvrelay",))
    body = json.loads(out.removeprefix(b"data: "))
    assert body["choices"][0]["delta"]["content"] == "x\ud83d" and body["kv_transfer_params"] == {"kvrelay_ttft": {}}


def test_the_gateway_s_error_event_is_a_responses_error_and_an_sdk_error():
    name, data = error_event("the upstream stalled", "timeout", "upstream_timeout", 12).decode().strip().split("\n")
    body = json.loads(data.removeprefix("data: "))
    assert name == "event: error"
    assert (body["type"], body["sequence_number"], body["code"], body["message"]) == (
        "error", 12, "upstream_timeout", "the upstream stalled")
    assert body["error"]["type"] == "timeout"


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=10)
_OUTPUT = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call"])},
                                         optional={"call_id": _JSON, "content": _JSON}), max_size=3)
_TYPES = st.sampled_from(["response.output_text.delta", "response.output_item.added", "response.output_item.done",
                          "response.completed", "response.incomplete", "response.failed", "error",
                          "response.function_call_arguments.delta", "response.created"])


@given(_TYPES, st.dictionaries(st.sampled_from(["delta", "item", "response", "sequence_number", "message"]),
                               _JSON | st.fixed_dictionaries({"output": _OUTPUT | _JSON, "status": _JSON,
                                                              "usage": _JSON, "incomplete_details": _JSON})))
@settings(max_examples=300, deadline=None)
def test_no_responses_event_breaks_the_inspection(kind, fields):
    info = inspect(event(kind, **fields))
    assert isinstance(info.text, str) and all(isinstance(c, str) for c in info.tool_call_ids)
    if info.kv_transfer_params is not None:
        event_without_params(event(kind, **fields), ("kvrelay",))
    if isinstance(fields.get("response"), dict):
        answer_facts(fields["response"])
