"""The SSE parser under hostile upstream streams: any bytes, cut anywhere, are split
into events and parsed without an exception, nothing is lost or duplicated, and hostile
shapes (one endless event, thousands of tiny events, odd line endings) take time at
most linear in their size (asserted as a complexity ratio, best of three runs)."""

from __future__ import annotations


import hypothesis
import pytest
from hypothesis import strategies as st

from kvrelay.gateway.sse import EventReader, inspect
from tests.helpers import LINEAR_RATIO_BOUND, cpu_ratio

CHUNK = 1024


def relay(stream: bytes, chunk: int = CHUNK) -> tuple[list[bytes], bytes]:
    """What the gateway's relay does with a stream arriving `chunk` bytes at a time."""
    reader, events = EventReader(), []
    for start in range(0, len(stream), chunk):
        for event in reader.feed(stream[start : start + chunk]):
            inspect(event)
            events.append(event)
    return events, reader.rest


SHAPES = {
    "one endless event": lambda n: b"data: " + b"x" * n,
    "thousands of tiny events": lambda n: b"data: {}\n\n" * (n // 10),
    "carriage returns only": lambda n: b"data: 1\r\r" * (n // 9),
    "blank-line storms": lambda n: b"\n" * n,
    "json nested deep": lambda n: b"data: " + b"[" * (n // 2) + b"]" * (n // 2) + b"\n\n",
}


@pytest.mark.parametrize("shape", SHAPES)
def test_hostile_streams_take_linear_time(shape):
    small, large = SHAPES[shape](200_000), SHAPES[shape](800_000)
    ratio = cpu_ratio(lambda: relay(small), lambda: relay(large))
    assert ratio < LINEAR_RATIO_BOUND, f"4x the stream took {ratio:.1f}x the time"


@hypothesis.given(stream=st.binary(max_size=2000), chunk=st.integers(min_value=1, max_value=64))
@hypothesis.settings(max_examples=300, deadline=None, database=None)
def test_any_bytes_cut_anywhere_are_split_losslessly(stream, chunk):
    events, rest = relay(stream, chunk)
    assert b"".join(events) + rest == stream


@hypothesis.given(body=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                                        st.sampled_from(["choices", "delta", "content", "usage", "error",
                                                         "kv_transfer_params", "text", "finish_reason"]),
                                        inner, max_size=4), max_leaves=30))
@hypothesis.settings(max_examples=300, deadline=None, database=None)
def test_any_json_in_an_event_is_inspected_without_an_exception(body):
    import json

    info = inspect(b"data: " + json.dumps(body).encode() + b"\n\n")
    assert isinstance(info.text, str)
