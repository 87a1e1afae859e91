"""Each route's reading of its bodies and answers, without servers: the chat and text
completion endpoints, and the registry the routes take their endpoint from."""

from __future__ import annotations

import json

import pytest

from kvrelay.gateway.endpoints import ENDPOINTS, ChatCompletions, Completions, Responses
from kvrelay.gateway.errors import BadRequestError
from kvrelay.gateway.settings import LimitSettings

LIMITS = LimitSettings()
MESSAGES = [{"role": "user", "content": "Hi"}]


def test_the_registry_holds_one_endpoint_per_route():
    assert {path: type(endpoint) for path, endpoint in ENDPOINTS.items()} == {
        "/v1/chat/completions": ChatCompletions, "/v1/completions": Completions, "/v1/responses": Responses}
    with pytest.raises(TypeError):
        ENDPOINTS["/v1/embeddings"] = ChatCompletions()  # type: ignore[index]


def test_a_chat_body_is_its_own_view_and_its_messages_are_the_prompt_text():
    body = {"model": "m", "messages": MESSAGES}
    view = ChatCompletions().view(body, LIMITS)
    assert view.body is body and json.loads(view.text) == MESSAGES
    for bad in ({"model": "m"}, {"model": "m", "messages": []}, {"model": "m", "messages": ["hi"]}):
        with pytest.raises(BadRequestError) as err:
            ChatCompletions().view(bad, LIMITS)
        assert err.value.param == "messages"
    many = {"model": "m", "messages": MESSAGES * (LIMITS.max_messages + 1)}
    with pytest.raises(BadRequestError):
        ChatCompletions().view(many, LIMITS)


def test_a_completions_prompt_is_text_or_a_list():
    assert Completions().view({"prompt": "Once"}, LIMITS).text == "Once"
    assert Completions().view({"prompt": ["a", "b"]}, LIMITS).text == '["a", "b"]'
    for bad in ({}, {"prompt": ""}, {"prompt": 5}):
        with pytest.raises(BadRequestError) as err:
            Completions().view(bad, LIMITS)
        assert err.value.param == "prompt"


def test_a_stream_asks_for_usage_and_strips_it_only_when_the_client_did_not():
    body = {"model": "m", "messages": MESSAGES}
    assert ChatCompletions().upstream_body(body, stream=False) == (body, False)
    sent, strip = ChatCompletions().upstream_body({**body, "stream_options": {"x": 1}}, stream=True)
    assert sent["stream_options"] == {"x": 1, "include_usage": True} and strip
    asked = {**body, "stream_options": {"include_usage": True}}
    assert Completions().upstream_body(asked, stream=True) == (asked, False)
    assert Responses().upstream_body(body, stream=True) == (body, False)  # its final event carries the usage


def test_the_facts_of_an_answer_are_read_leniently():
    chat = {"choices": [{"message": {"content": "Hel", "tool_calls": [{"id": "c1"}]}, "finish_reason": "tool_calls"},
                        {"message": {"content": None}, "finish_reason": "stop"}, "junk"],
            "usage": {"prompt_tokens": 3}}
    facts = ChatCompletions().answer(chat)
    assert (facts.text, facts.call_ids, facts.usage, facts.finish_reasons, facts.response_id) == (
        "Hel", ("c1",), {"prompt_tokens": 3}, ("tool_calls", "stop"), None)
    text = Completions().answer({"choices": [{"text": "lo", "finish_reason": "length"}], "usage": "nonsense"})
    assert (text.text, text.usage, text.finish_reasons) == ("lo", None, ("length",))
    assert ChatCompletions().answer({"choices": "nonsense"}).text == ""


def test_only_a_responses_body_continues_an_earlier_answer():
    assert Responses().continues({"previous_response_id": "resp_1"}) == "resp_1"
    assert Responses().continues({"previous_response_id": 7}) is None
    assert ChatCompletions().continues({"previous_response_id": "resp_1"}) is None


def test_the_gateway_s_own_stream_error_takes_each_route_s_shape():
    chunk = ChatCompletions().stream_error("broke", "upstream_error", "upstream_failed", last_sequence=-1)
    assert json.loads(chunk.removeprefix(b"data: "))["error"]["code"] == "upstream_failed"
    event = Responses().stream_error("broke", "upstream_error", "upstream_failed", last_sequence=6)
    assert event.startswith(b"event: error\n")
    assert json.loads(event.split(b"data: ")[1])["sequence_number"] == 7
