"""kvrelay.gateway.sse's short paths (one data line, one choice, UTF-8 JSON, whole LF events fed
at once) give exactly what the general code gives: checked against that code, kept
here as the reference, on generated events and streams."""

from __future__ import annotations

import json
import re
from typing import Any

import hypothesis
from hypothesis import strategies as st

from kvrelay.gateway.sse import EventInfo, EventReader, finish_reasons_of, inspect

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_NOTHING = EventInfo(False, "", None, False, None, ())


def reference_inspect(event: bytes) -> EventInfo:
    """inspect() as it was before the short paths."""
    data = b"".join(line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return _NOTHING
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return _NOTHING
    if not isinstance(body, dict):
        return _NOTHING
    listed = body.get("choices")
    choices = [c for c in listed if isinstance(c, dict)] if isinstance(listed, list) else []
    has_content = any(_has_content(c) for c in choices)
    text = "".join(_text(c) for c in choices)
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
    error = body.get("error") if isinstance(body.get("error"), dict) else None
    params = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else None
    return EventInfo(has_content, text, usage, usage is not None and not choices, error, finish_reasons_of(choices),
                     params)


def _has_content(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))
    return bool(choice.get("text"))


def _text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def reference_split(stream: bytes) -> tuple[list[bytes], bytes]:
    """Every complete event of the whole stream, and the rest."""
    events, start = [], 0
    for match in _BOUNDARY.finditer(stream):
        events.append(stream[start:match.end()])
        start = match.end()
    return events, stream[start:]


scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(allow_nan=False)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["content", "text", "tool_calls", "reasoning_content", "role", "finish_reason", "x"]),
    inner, max_size=3), max_leaves=12)
deltas = st.dictionaries(st.sampled_from(["content", "tool_calls", "reasoning_content", "role"]),
                         st.text(max_size=8) | values, max_size=3)
choice = st.fixed_dictionaries({}, optional={
    "index": st.integers(0, 3), "delta": deltas | values, "text": st.text(max_size=8) | values,
    "finish_reason": st.none() | st.sampled_from(["stop", "length", "tool_calls"]) | values})
bodies = st.fixed_dictionaries({}, optional={
    "id": st.text(max_size=8), "choices": st.lists(choice | values, max_size=3) | values,
    "usage": st.dictionaries(st.sampled_from(["prompt_tokens", "completion_tokens"]), st.integers(0, 99)) | values,
    "error": st.dictionaries(st.sampled_from(["message", "code"]), st.text(max_size=8)) | values,
    "kv_transfer_params": st.dictionaries(st.sampled_from(["kvrelay_plan", "kvrelay_ttft", "other"]), values) | values,
}) | values
encodings = st.sampled_from([
    lambda b: json.dumps(b), lambda b: json.dumps(b, separators=(",", ":")),
    lambda b: json.dumps(b, ensure_ascii=False), lambda b: " " + json.dumps(b, indent=1)])


def as_event(data: bytes, form: int) -> bytes:
    if form == 0:
        return b"data: " + data + b"\n\n"
    if form == 1:
        return b"data:" + data + b"\r\n\r\n"
    if form == 2:  # the data split over two lines, with an event name
        half = len(data) // 2
        return b"event: x\ndata: " + data[:half] + b"\ndata: " + data[half:] + b"\n\n"
    return b": comment\ndata: " + data + b"\n\n"


@hypothesis.given(body=bodies, encode=encodings, form=st.integers(0, 3))
@hypothesis.settings(max_examples=500, deadline=None, database=None)
def test_inspect_agrees_with_the_general_code_on_json_events(body, encode, form):
    event = as_event(encode(body).encode(), form)
    assert inspect(event) == reference_inspect(event)


@hypothesis.given(event=st.binary(max_size=300) | st.builds(lambda b: b"data: " + b, st.binary(max_size=300)))
@hypothesis.settings(max_examples=500, deadline=None, database=None)
def test_inspect_agrees_with_the_general_code_on_any_bytes(event):
    assert inspect(event) == reference_inspect(event)


def test_inspect_short_path_edge_cases_agree():
    for event in [b"data:\n\n", b"data: {}\n\n", b"data: {\x00}\n\n", b"data: {\n\n", b"data: [DONE]\n\n",
                  b"data: {\"choices\":[1]}\n\n", b"data: {\"choices\":[{}]}\nX", b"data:\t{\"a\":1}\n\n",
                  "data: {\"choices\":[{\"delta\":{\"content\":\"\\ud800\"}}]}\n\n".encode(),
                  b'data: {"choices":[{"delta":{"content":"\xed\xa0\x80"}}]}\n\n', b"\xef\xbb\xbfdata: {}\n\n",
                  b'data: {"usage":{}}\n\n', b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n']:
        assert inspect(event) == reference_inspect(event), event


stream_parts = st.lists(st.sampled_from([b"data: {\"a\":1}", b"data: x", b"", b"\n", b"\r", b": c", b"event: e"]),
                        max_size=12)


@hypothesis.given(parts=stream_parts, seps=st.lists(st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r", b"\n", b""]),
                                                  min_size=12, max_size=12),
                  cuts=st.lists(st.integers(0, 200), max_size=6))
@hypothesis.settings(max_examples=500, deadline=None, database=None)
def test_reader_agrees_with_splitting_the_whole_stream(parts, seps, cuts):
    stream = b"".join(p + s for p, s in zip(parts, seps))
    reader, events, start = EventReader(), [], 0
    for cut in sorted({min(c, len(stream)) for c in cuts}) + [len(stream)]:
        events += reader.feed(stream[start:cut])
        start = cut
    assert (events, reader.rest) == reference_split(stream)


def test_reader_whole_lf_events_in_one_read():
    reader = EventReader()
    assert reader.feed(b"data: a\n\n") == [b"data: a\n\n"]
    assert reader.feed(b"data: a\n\n\n\ndata: b\n\n") == [b"data: a\n\n", b"\n\n", b"data: b\n\n"]
    assert reader.feed(b"data: a\n\n\ndata: b\n\n") == [b"data: a\n\n", b"\ndata: b\n\n"]
    assert reader.feed(b"data: c") == [] and reader.feed(b"\n\n") == [b"data: c\n\n"]
    assert reader.rest == b""
    assert reader.feed(b"data: d\n\n\n") == [b"data: d\n\n"] and reader.rest == b"\n"  # an unfinished "\n"
