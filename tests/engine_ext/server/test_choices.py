"""The answer shape of each completions route, without an engine: ids, object names,
a unary choice and a stream chunk's choice."""

from __future__ import annotations

from engine_ext.server.choices import ChatChoices, TextChoices, choices_for, finish_with_calls
from engine_ext.server.schemas import ChatCompletionRequest, CompletionRequest
from engine_ext.tools.calls import ToolCall

CALL = ToolCall("call_1", "weather", '{"city": "Oslo"}')


def blank(finish: str | None = "stop") -> dict:
    return {"index": 0, "logprobs": None, "finish_reason": finish}


def test_each_request_type_gets_its_route_s_shape():
    chat = choices_for(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]))
    text = choices_for(CompletionRequest(model="m", prompt="hi"))
    assert isinstance(chat, ChatChoices) and isinstance(text, TextChoices)
    assert chat.new_id().startswith("chatcmpl-") and text.new_id().startswith("cmpl-")
    assert chat.new_id() != chat.new_id()
    assert [chat.envelope("i", "m:a", chunk)["object"] for chunk in (False, True)] == [
        "chat.completion", "chat.completion.chunk"]
    assert {text.envelope("i", "m", chunk)["object"] for chunk in (False, True)} == {"text_completion"}
    assert (chat.operation, text.operation, chat.opens_with_role, text.opens_with_role) == (
        "chat", "text_completion", True, False)


def test_a_unary_choice_holds_the_message_or_the_text():
    choice = blank()
    ChatChoices().answer(choice, "Sunny.", None)
    assert choice["message"] == {"role": "assistant", "content": "Sunny."} and choice["finish_reason"] == "stop"
    choice = blank("length")
    TextChoices().answer(choice, "Once upon", None)
    assert choice["text"] == "Once upon" and "message" not in choice


def test_a_chunk_choice_opens_with_the_role_then_carries_text_or_calls():
    opening, text, calls, end = blank(None), blank(None), blank(None), blank("stop")
    ChatChoices().delta(opening, None, True, ())
    ChatChoices().delta(text, "Hel", False, ())
    ChatChoices().delta(calls, None, False, (CALL,))
    ChatChoices().delta(end, None, False, ())
    assert opening["delta"] == {"role": "assistant", "content": ""} and text["delta"] == {"content": "Hel"}
    assert calls["delta"] == {"tool_calls": [{"index": 0, **CALL.to_openai()}]} and end["delta"] == {}
    plain = blank(None)
    TextChoices().delta(plain, None, False, ())
    assert plain["text"] == ""


def test_an_answer_of_tool_calls_finishes_with_tool_calls_unless_cut_short():
    assert finish_with_calls("stop") == "tool_calls"
    assert finish_with_calls("length") == "length" and finish_with_calls(None) is None
