"""The Responses API translation (kvrelay/openai_responses*.py) against hand-written
chat bodies and chunks: requests become chat requests (or are refused naming the
field), chat answers become Responses the official SDK parses, and chat streams become
event streams the SDK's own stream state accumulates into the same Response."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvrelay.openai_responses import ResponsesRequestError, chat_messages, parse_request, to_chat
from kvrelay.openai_responses_output import answer_message, response_from_chat
from kvrelay.openai_responses_stream import ResponsesStream

EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 6}}
TOOL = {"type": "function", "name": "weather", "description": "Weather now", "parameters": {"type": "object"},
        "strict": True}


def chat_for(**fields: Any) -> dict[str, Any]:
    return to_chat(parse_request({"model": "m", "input": "hi", **fields}))


# -- requests ------------------------------------------------------------------------------
def test_a_string_input_and_instructions_become_system_and_user_messages():
    assert chat_for(instructions="Be brief.") == {
        "model": "m", "stream": False,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}


def test_items_become_messages_calls_merge_into_the_assistant_turn():
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "now?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]},
        {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": "{}"},
    ]
    assert chat_messages(items) == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "Weather now?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
    ]


def test_history_goes_after_the_instructions_and_before_the_input():
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "answer"}]
    req = parse_request({"model": "m", "input": "now", "instructions": "Sys."})
    assert [m["content"] for m in to_chat(req, history)["messages"]] == ["Sys.", "earlier", "answer", "now"]


def test_settings_translate_to_their_chat_names():
    chat = chat_for(tools=[TOOL], tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False,
                    text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"},
                                     "strict": True}, "verbosity": "low"},
                    max_output_tokens=64, temperature=0.2, top_p=0.9, seed=7, stream=True,
                    kv_transfer_params={"a": 1}, metadata={"k": "v"}, store=False, user="u", service_tier="auto",
                    prompt_cache_key="p", safety_identifier="s", include=["reasoning.encrypted_content"])
    assert chat == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather now",
                                                    "parameters": {"type": "object"}, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"},
                                                                   "strict": True}},
        "parallel_tool_calls": False, "max_completion_tokens": 64, "temperature": 0.2, "top_p": 0.9, "seed": 7,
        "kv_transfer_params": {"a": 1}}
    assert chat_for(text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert chat_for(tool_choice="required", tools=[TOOL])["tool_choice"] == "required"


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "input_text", "text": "b"}, {"type": "input_file", "file_id": "f"}]}]}, "input[1].content[1]"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image", "image_url": "u"}]}]}, "input[0].output[0]"),
    ({"input": [{"type": "reasoning", "id": "rs", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"type": "item_reference", "id": "msg_1"}]}, "input[2].type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input[0].type"),
    ({"tools": [TOOL, {"type": "web_search"}]}, "tools[1].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
    ({"tools": [{"type": "custom", "name": "x"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice.name"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "medium"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"conversation": {"id": "conv_1"}}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"input": 3}, "input"),
    ({"input": ["text"]}, "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": None}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"input": "\ud800"}, "input"),
    ({"seed": 2**70}, "seed"),
])
def test_refusals_name_the_field(fields, param):
    with pytest.raises(ResponsesRequestError) as err:
        chat_for(**fields)
    assert err.value.param == param, err.value.message
    assert err.value.message


def test_accepted_settings_without_effect_are_refused_by_nothing():
    """Settings a Responses client may send that change nothing here are accepted, and
    none of them reaches the chat view (an engine could refuse a field it does not know)."""
    plain = chat_for()
    assert chat_for(reasoning={"effort": None, "summary": None}, include=[], truncation="disabled", store=True,
                    background=False, top_logprobs=0, max_tool_calls=3,
                    stream_options={"include_obfuscation": False}, prompt_cache_retention="24h",
                    unknown_future_field={"x": 1}) == plain
    assert chat_for(reasoning={"effort": "none"}) == plain


def test_the_lenient_view_leaves_out_what_the_engine_refuses():
    req = parse_request({"model": "m", "background": True, "tools": [TOOL, {"type": "web_search"}],
                         "tool_choice": {"type": "web_search"},
                         "input": [{"type": "reasoning", "id": "rs", "summary": []},
                                   {"role": "user", "content": [{"type": "input_text", "text": "look: "},
                                                                {"type": "input_image", "image_url": "u"}]}]})
    chat = to_chat(req, strict=False)
    assert chat["messages"] == [{"role": "user", "content": "look: "}]
    assert [t["function"]["name"] for t in chat["tools"]] == ["weather"] and chat["tool_choice"] == "auto"
    with pytest.raises(ResponsesRequestError):  # a malformed item is malformed either way
        chat_messages([{"type": "function_call", "name": "f"}], strict=False)


# -- responses -----------------------------------------------------------------------------
def chat_answer(content: str | None, calls: list[dict] | None = None, finish: str = "stop") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": USAGE,
            "kv_transfer_params": {"kvrelay_reuse": {"segments": []}}}


CALLS = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
         {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Rome\"}"}}]


def test_a_text_answer_is_a_completed_response_the_sdk_parses():
    req = parse_request({"model": "m", "input": "hi", "instructions": "Sys.", "tools": [TOOL], "metadata": {"k": "v"},
                         "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
                         "previous_response_id": "resp_0", "store": False, "max_output_tokens": 9})
    body = response_from_chat(req, chat_answer("Hello"))
    resp = Response.model_validate(body)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.created_at == 1700000000
    assert (resp.status, resp.output_text, resp.incomplete_details) == ("completed", "Hello", None)
    assert resp.output[0].id.startswith("msg_") and resp.output[0].content[0].annotations == []
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (10, 4, 14)
    assert resp.usage.input_tokens_details.cached_tokens == 6
    assert (resp.instructions, resp.metadata, resp.previous_response_id, resp.store) == ("Sys.", {"k": "v"},
                                                                                         "resp_0", False)
    assert resp.tools[0].name == "weather" and resp.text.format.type == "json_schema"
    assert resp.max_output_tokens == 9 and resp.tool_choice == "auto"
    assert body["kv_transfer_params"] == {"kvrelay_reuse": {"segments": []}}


def test_tool_calls_become_function_call_items_and_length_incomplete():
    req = parse_request({"model": "m", "input": "hi"})
    resp = Response.model_validate(response_from_chat(req, chat_answer(None, CALLS, "tool_calls")))
    assert [item.type for item in resp.output] == ["function_call", "function_call"]
    assert [(i.call_id, i.name, i.arguments) for i in resp.output] == [
        ("call_1", "weather", "{\"city\":\"Oslo\"}"), ("call_2", "weather", "{\"city\":\"Rome\"}")]
    assert all(i.id.startswith("fc_") and i.status == "completed" for i in resp.output)
    cut = Response.model_validate(response_from_chat(req, chat_answer("Hel", None, "length")))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"
    empty = Response.model_validate(response_from_chat(req, chat_answer("")))
    assert [i.type for i in empty.output] == ["message"] and empty.output_text == ""


def test_an_answer_s_items_are_its_chat_message_again():
    req = parse_request({"model": "m", "input": "hi"})
    both = response_from_chat(req, chat_answer("Checking.", CALLS, "tool_calls"))
    assert answer_message(both["output"]) == {"role": "assistant", "content": "Checking.", "tool_calls": CALLS}
    text = response_from_chat(req, chat_answer("Hi"))
    assert answer_message(text["output"]) == {"role": "assistant", "content": "Hi"}


# -- streams -------------------------------------------------------------------------------
def chunk(delta: dict | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}


def run_stream(chunks: list[dict], **fields: Any) -> tuple[list[Any], ResponsesStream]:
    """The events of a translated stream, each parsed by the SDK, checked in order and
    fed through the SDK's own stream state (which refuses inconsistent streams)."""
    stream = ResponsesStream(parse_request({"model": "m", "input": "hi", "stream": True, **fields}))
    texts = stream.start() + [e for c in chunks for e in stream.feed(c)] + stream.finish()
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    events = []
    for text in texts:
        name, data = text.removesuffix("\n\n").split("\n")
        event = EVENT.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        state.handle_event(event)
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, stream


def test_a_text_stream_becomes_the_message_events_and_a_completed_response():
    events, stream = run_stream([chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
                                 chunk({"content": "lo"}), chunk(finish="stop", kv_transfer_params={"r": 1}),
                                 {"choices": [], "usage": USAGE}])
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert final.output_text == "Hello" and final.usage.output_tokens == 4 and final.status == "completed"
    assert final.model_extra["kv_transfer_params"] == {"r": 1}
    assert events[0].response.id == final.id == stream.id and events[0].response.status == "in_progress"
    assert stream.finished and Response.model_validate(stream.response) == final


def test_tool_call_deltas_become_function_call_items():
    events, _ = run_stream([
        chunk({"role": "assistant", "content": ""}), chunk({"content": "Checking."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "weather", "arguments": "{}"}}]}),
        chunk(finish="tool_calls"), {"choices": [], "usage": USAGE}])
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 3 and kinds.count("response.output_item.done") == 3
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.output_index, e.arguments) for e in done] == [(1, "{\"city\":\"Oslo\"}"), (2, "{}")]
    # Each item closes before the next one opens, as OpenAI streams them.
    opened = [(e.output_index, i) for i, e in enumerate(events) if e.type == "response.output_item.added"]
    closed = {e.output_index: i for i, e in enumerate(events) if e.type == "response.output_item.done"}
    assert all(closed[index] < opened[k + 1][1] for k, (index, _) in enumerate(opened[:-1]))
    final = events[-1].response
    assert [i.type for i in final.output] == ["message", "function_call", "function_call"]
    assert [i.call_id for i in final.output[1:]] == ["call_1", "call_2"]
    assert final.output_text == "Checking." and final.status == "completed"


def test_a_stream_cut_by_the_token_bound_is_incomplete_and_an_empty_one_has_an_empty_message():
    events, _ = run_stream([chunk({"content": "Hel"}), chunk(finish="length"), {"choices": [], "usage": USAGE}])
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].status == "incomplete"
    events, _ = run_stream([chunk({"role": "assistant", "content": ""}), chunk(finish="stop")])
    assert events[-1].response.output_text == "" and events[-1].response.usage is None
    assert [e.type for e in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]


def test_an_in_band_error_or_a_cut_stream_fails_the_response():
    events, stream = run_stream([chunk({"content": "Hel"}),
                                 {"error": {"message": "the engine died", "type": "service_unavailable",
                                            "param": None, "code": None}},
                                 chunk({"content": "ignored"})])
    assert events[-1].type == "response.failed" and stream.finished
    failed = events[-1].response
    assert (failed.status, failed.error.code, failed.error.message) == ("failed", "server_error", "the engine died")
    assert failed.output[0].status == "incomplete" and failed.output_text == "Hel"
    events, _ = run_stream([chunk({"content": "Hel"})])  # no finish reason ever came
    assert events[-1].type == "response.failed"


# -- any body ------------------------------------------------------------------------------
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=8)
_KINDS = ["message", "function_call", "function_call_output", "reasoning", "item_reference", None]
_PART = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["input_text", "output_text", "refusal", "input_image", "text", "x"]) | _JSON,
    "text": st.text(max_size=5) | _JSON, "refusal": st.text(max_size=5)})
_ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(_KINDS) | _JSON, "role": st.sampled_from(["user", "assistant", "system", "tool"]) | _JSON,
    "content": st.text(max_size=5) | st.lists(_PART | _JSON, max_size=3) | _JSON,
    "call_id": st.text(max_size=4) | _JSON, "name": st.text(max_size=4) | _JSON,
    "arguments": st.text(max_size=4) | _JSON, "output": st.text(max_size=4) | st.lists(_PART, max_size=2) | _JSON})
_BODY = st.fixed_dictionaries({"model": st.text(min_size=1, max_size=4),
                               "input": st.text(max_size=5) | st.lists(_ITEM | _JSON, max_size=4) | _JSON},
                              optional={key: _JSON for key in (
                                  "instructions", "tools", "tool_choice", "text", "reasoning", "include", "background",
                                  "truncation", "temperature", "max_output_tokens", "metadata", "stream")})


@given(_BODY)
@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
def test_any_body_translates_or_is_refused_naming_a_field(body):
    """Nothing but a ResponsesRequestError escapes, and when the engine's strict
    translation accepts a body, the gateway's lenient view is the same."""
    try:
        req = parse_request(body)
        lenient = to_chat(req, strict=False)
    except ResponsesRequestError as exc:
        assert exc.message
        return
    try:
        strict = to_chat(req)
    except ResponsesRequestError as exc:
        assert exc.param is None or isinstance(exc.param, str)
        return
    assert strict["messages"] == lenient["messages"]
    json.dumps(strict)
