"""kvrelay.gateway.sse: splitting a byte stream into events and looking inside them."""

from __future__ import annotations

import json

import pytest

from kvrelay.gateway.sse import inspect, split_events


def data(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def feed(stream: bytes, sizes) -> tuple[list[bytes], bytes]:
    """Split `stream` arriving in pieces of the given sizes, as the relay does."""
    events, pending, pos = [], b"", 0
    for size in sizes:
        got, pending = split_events(pending + stream[pos:pos + size])
        events += got
        pos += size
    got, pending = split_events(pending + stream[pos:])
    return events + got, pending


def test_split_lf_events():
    events, rest = split_events(b"data: a\n\ndata: b\n\n")
    assert (events, rest) == ([b"data: a\n\n", b"data: b\n\n"], b"")


def test_split_crlf_and_cr_events():
    events, rest = split_events(b"data: a\r\n\r\nevent: x\r\ndata: b\r\n\r\ndata: c\r\r")
    assert events == [b"data: a\r\n\r\n", b"event: x\r\ndata: b\r\n\r\n", b"data: c\r\r"]
    assert rest == b""


def test_split_keeps_the_unfinished_rest():
    events, rest = split_events(b"data: a\n\ndata: {\"partial\":")
    assert events == [b"data: a\n\n"]
    assert rest == b'data: {"partial":'
    assert split_events(b"") == ([], b"")
    assert split_events(b"data: a\n") == ([], b"data: a\n")
    assert split_events(b"data: a\r\n\r") == ([], b"data: a\r\n\r")


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64])
def test_split_across_chunk_boundaries_keeps_every_byte(sep, size):
    bodies = [b'data: {"choices":[{"delta":{"content":"h\xc3\xa9"}}]}', b": keep-alive",
              b"event: ping\ndata: 1".replace(b"\n", sep[: len(sep) // 2]), b"data: [DONE]"]
    stream = b"".join(b + sep for b in bodies)
    events, rest = feed(stream, [size] * (len(stream) // size))
    assert events == [b + sep for b in bodies]
    assert rest == b""
    assert b"".join(events) == stream


def test_inspect_content_chunk():
    info = inspect(data({"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}))
    assert (info.has_content, info.text, info.usage, info.is_usage_only, info.error) == (True, "Hello", None, False,
                                                                                          None)


def test_inspect_role_only_and_empty_chunks_have_no_content():
    role = inspect(data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    assert (role.has_content, role.text) == (False, "")
    finish = inspect(data({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    assert (finish.has_content, finish.text, finish.usage) == (False, "", None)


def test_inspect_text_completion_and_tool_call_chunks():
    text = inspect(data({"choices": [{"index": 0, "text": " world"}]}))
    assert (text.has_content, text.text) == (True, " world")
    tool = inspect(data({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]}))
    assert (tool.has_content, tool.text) == (True, "")
    reasoning = inspect(data({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}))
    assert reasoning.has_content


def test_inspect_reports_the_ids_of_the_tool_calls_a_chunk_opens():
    opened = inspect(data({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_a", "function": {"name": "f", "arguments": ""}},
        {"index": 1, "id": "call_b", "function": {"name": "g", "arguments": ""}}]}}]}))
    assert opened.tool_call_ids == ("call_a", "call_b")
    more = inspect(data({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}))
    assert more.tool_call_ids == ()  # argument pieces carry no id
    odd = inspect(data({"choices": [{"index": 0, "delta": {"tool_calls": [{"id": 7}, "x", {"id": ""}]}}]}))
    assert odd.tool_call_ids == ()


def test_inspect_usage_only_chunk():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    info = inspect(data({"id": "x", "choices": [], "usage": usage}))
    assert (info.has_content, info.usage, info.is_usage_only) == (False, usage, True)
    # usage riding on a content chunk is not a usage-only chunk (it must not be stripped)
    mixed = inspect(data({"choices": [{"index": 0, "delta": {"content": "x"}}], "usage": usage}))
    assert (mixed.usage, mixed.is_usage_only, mixed.has_content) == (usage, False, True)
    # a null usage is no usage
    assert inspect(data({"choices": [{"index": 0, "delta": {"content": "x"}}], "usage": None})).usage is None


def test_inspect_error_event():
    err = {"message": "boom", "type": "server_error", "param": None, "code": None}
    info = inspect(data({"error": err}))
    assert (info.error, info.has_content, info.usage) == (err, False, None)


@pytest.mark.parametrize("event", [
    b"data: [DONE]\n\n", b": comment\n\n", b"data: not json\n\n", b"data: [1, 2]\n\n", b"data: 42\n\n",
    b"event: ping\n\n", b"", b"data: {\"choices\": \"nope\"}\n\n", b"data: {\"choices\": [1, \"x\"]}\n\n",
])
def test_inspect_ignores_what_it_does_not_understand(event):
    info = inspect(event)
    assert (info.has_content, info.text, info.usage, info.is_usage_only, info.error) == (False, "", None, False, None)


def test_inspect_line_variants():
    crlf = b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n'
    assert inspect(crlf).text == "a"
    tight = b'data:{"choices":[{"delta":{"content":"b"}}]}\n\n'
    assert inspect(tight).text == "b"
    with_fields = b'id: 7\nevent: message\ndata: {"choices":[{"delta":{"content":"c"}}]}\n\n'
    assert inspect(with_fields).text == "c"
    split_data = b'data: {"choices":[{"delta":\ndata: {"content":"d"}}]}\n\n'
    assert inspect(split_data).text == "d"
