"""DeltaReader says of every event of a stream exactly what inspect() says: on generated
streams of plain and odd deltas (escapes, quotes, control characters, keys spelled with
escapes, a second "content", UTF-16), and on streams of arbitrary events."""

from __future__ import annotations

import json

import hypothesis
from hypothesis import strategies as st

from kvrelay.gateway.sse import EventInfo, inspect
from kvrelay.gateway.sse_deltas import MAX_LEARNED, DeltaReader


def chunk(delta: dict, finish: str | None = None, compact: bool = True, **extra: object) -> bytes:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", **extra,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(body, separators=(",", ":") if compact else None).encode() + b"\n\n"


def read_all(events: list[bytes]) -> list[object]:
    """What the reader says of each event; where skeleton_text reads one (as the relay
    does first), it says the same as inspect."""
    reader, infos = DeltaReader(), []
    for event in events:
        text = reader.skeleton_text(event)
        info = reader.inspect(event)
        if text is not None:
            assert info == EventInfo(bool(text), text, None, False, None, ())
        infos.append(info)
    return infos


def test_plain_deltas_are_read_by_skeleton_and_agree():
    texts = [" w0", "", " \"quoted\"", "back\\slash\\", "\u00e9\u4e2d\U0001F600", "\\\"", "x" * 500, "\n\t\u2028"]
    for compact in (True, False):
        events = [chunk({"role": "assistant", "content": ""}, compact=compact)]
        events += [chunk({"content": t}, compact=compact) for t in texts]
        events += [chunk({}, "stop", compact=compact), b"data: [DONE]\n\n"]
        assert read_all(events) == [inspect(e) for e in events]


def test_the_skeleton_is_used_after_one_plain_delta():
    reader = DeltaReader()
    reader.inspect(chunk({"content": "a"}))
    assert reader._skeleton is not None  # the fast path is taken, not only agreed with
    assert reader.inspect(chunk({"content": "b\\u00e9"})).text == "b\\u00e9"


def test_odd_events_with_the_skeleton_go_to_inspect():
    head = chunk({"content": "a"})
    odd = [
        head.replace(b'"a"', b'"\x01"'),  # a raw control character: not JSON
        head.replace(b'"a"', b'"\\x"'),  # a bad escape
        head.replace(b'"a"', b'"a","b"'),  # two values where one string was
        head.replace(b'"a"', b'"\xff"'),  # invalid UTF-8
        head.replace(b'"a"', b'"a" '),  # not the skeleton: a space more
        head.replace(b'"a"', b'""'),
        head.replace(b'"a"', b'"\xed\xa0\x80"'),  # a lone surrogate, as inspect reads it
        chunk({"content": "c"}, "stop"), chunk({"content": "c", "tool_calls": [{"id": "t1"}]}),
        chunk({"content": "c", "reasoning_content": "r"}), chunk({"content": "c"}, usage={"prompt_tokens": 1}),
        chunk({"content": "c"}, kv_transfer_params={"x": 1}), chunk({"content": "c"}, error={"message": "m"}),
    ]
    events = [head] + [e for o in odd for e in (o, head)]
    assert read_all(events) == [inspect(e) for e in events]


def test_skeletons_that_would_mislead_are_not_learned():
    for event in [
        # an escaped key spells "content" for the delta; the literal one is another object's
        b'data: {"x":{"content":"a"},"choices":[{"delta":{"cont\\u0065nt":"a"}}]}\n\n',
        # a second "content" key: the parser keeps the last
        b'data: {"choices":[{"delta":{"content":"a","content":"b"}}]}\n\n',
        # the literal key belongs to a key that ends in an escaped quote
        b'data: {"q\\"content":"a","choices":[{"delta":{"content":"a"}}]}\n\n',
        "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n".encode("utf-16-le"),
        # the delta's key spelt with a space before the colon; the literal one is another object's
        b'data: {"x":{"content":"a"},"choices":[{"delta":{"content" :"a"}}]}\n\n',
        # the first of two duplicate keys (the parser keeps the last), the last spelt with a space
        b'data: {"choices":[{"delta":{"content":"a","content" :"a"}}]}\n\n',
        # the string after "content": on a line of its own, and in a comment line
        b'data: {"choices":[{"delta":{"content":\n"a"\ndata: "a"}}]}\n\n',
        b': "content":"a"\ndata: {"choices":[{"delta":{"content" :"a"}}]}\n\n',
        # the delta's key split across two data lines, which inspect() joins
        b'data: {"x":{"content":"a"},"choices":[{"delta":{"cont\ndata:ent":"a"}}]}\n\n',
    ]:
        reader = DeltaReader()
        reader.inspect(event)
        assert reader._skeleton is None, event


def test_misleading_skeletons_disagree_with_nothing():
    """Each event of a pair above, then the same with the span's string changed: the reader
    says what inspect() says of both (what a skeleton learned from the first would get wrong)."""
    learned = b'data: {"x":{"content":"a"},"choices":[{"delta":{"content" :"a"}}]}\n\n'
    probe = learned.replace(b'{"content":"a"}', b'{"content":"b"}')
    assert read_all([learned, probe]) == [inspect(learned), inspect(probe)]


def test_the_last_of_duplicate_keys_is_learned_and_read_right():
    event = b'data: {"choices":[{"delta":{"content" :"z","content":"a"}}]}\n\n'
    reader = DeltaReader()
    assert reader.inspect(event) == inspect(event) and reader._skeleton is not None
    later = event.replace(b'"a"}', b'"b"}')
    assert reader.inspect(later) == inspect(later) and inspect(later).text == "b"


def test_learning_stops_after_max_learned():
    reader = DeltaReader()
    for i in range(MAX_LEARNED + 2):
        reader.inspect(chunk({"content": "a"}, obfuscation="x" * i))  # a field that changes every event
    assert reader._learned == MAX_LEARNED


texts = st.text(max_size=12) | st.sampled_from(["", "\"", "\\", "\\\"", "\"content\":", "\u0000", "\ud800"])
extras = st.fixed_dictionaries({}, optional={"usage": st.none() | st.just({"prompt_tokens": 1}),
                                             "type": st.none() | st.just("response.output_text.delta"),
                                             "system_fingerprint": st.text(max_size=4)})
deltas = st.fixed_dictionaries({"content": texts}, optional={
    "role": st.just("assistant"), "tool_calls": st.none() | st.just([{"id": "c1"}]),
    "reasoning_content": st.none() | texts})
events = st.builds(lambda d, f, c, e, a: chunk(d, f, c, **e).replace(b"data: ", b"data:" if a else b"data: "),
                   deltas, st.none() | st.just("stop"), st.booleans(), extras, st.booleans())
mutations = st.sampled_from([lambda e: e, lambda e: e.replace(b"\n\n", b"\r\n\r\n"), lambda e: e[:-3] + b"\n\n",
                             lambda e: b"event: x\n" + e, lambda e: e.replace(b'"content":', b'"content": '),
                             lambda e: e.replace(b'"content":', b'"content" :'),
                             lambda e: e.replace(b'"content":', b'"content":\ndata: '),
                             lambda e: e.replace(b'"model":', b'"content":"x","model":')])


@hypothesis.given(stream=st.lists(st.tuples(events, mutations), max_size=12))
@hypothesis.settings(max_examples=400, deadline=None, database=None)
def test_agrees_with_inspect_on_generated_streams(stream):
    events_ = [mutate(event) for event, mutate in stream]
    assert read_all(events_) == [inspect(e) for e in events_]


@hypothesis.given(base=st.binary(max_size=40), tokens=st.lists(st.binary(max_size=12), max_size=8))
@hypothesis.settings(max_examples=300, deadline=None, database=None)
def test_agrees_with_inspect_when_any_bytes_fill_the_skeleton(base, tokens):
    template = chunk({"content": "PLACE"}).replace(b'"model":"m"', b'"model":"' + base + b'"')
    stream = [template.replace(b"PLACE", b"a")] + [template.replace(b'"PLACE"', token) for token in tokens]
    assert read_all(stream) == [inspect(e) for e in stream]
