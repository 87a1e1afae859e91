"""A stream's content deltas, read through the skeleton they share.

The content deltas of one chat stream are the same bytes but for their text, e.g.
`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",
"choices":[{"index":0,"delta":{"content":"<text>"},"logprobs":null,"finish_reason":null}]}`.
inspect() parses each in full: about 15 us of the gateway's one core per event on a
2-core CI machine, some 20 events per request. `DeltaReader` learns the skeleton (the
bytes before the text's string literal, and after it) from an event that it parsed and
found plain: a text, and nothing else the gateway looks at. A later event made of that
skeleton around one JSON string is read by decoding that string alone.

Why that is exact. The learned event is one `data:` line (no other line, no CR), so
inspect() reads its JSON whole, and a later event made of the same head and tail around
one strict JSON string is one line too (such a string holds no raw control character).
The span between head and tail is a value token of the learned JSON: the string after
its first `"content":` key (a key, since that byte sequence cannot sit inside a string).
A JSON parser reads the identical head alike, then a string token either way, then the
identical tail alike: the two events parse to the same tree but for the value in that
one place. Whether that place is the delta's content (and not another object's
"content", the first of two duplicate keys, or a key spelt `"content" :`) is checked,
not assumed: the learned event is parsed again with another string in the span, and
must give that string as its text. The other fields inspect() reads are the same in
every such event, and the learned one has none set (no tool call, reasoning, finish
reason, usage, error or engine report). No NUL in head or tail: the JSON is UTF-8, as
the token is decoded, not UTF-16 or 32. Anything else goes to inspect(), and
tests/gateway/test_sse_deltas.py checks the two agree on generated streams and on
events built to mislead.
"""

from __future__ import annotations

from _json import scanstring  # what json.decoder uses: the C scanner
from typing import Any, NamedTuple

from kvrelay.gateway.sse import EventInfo, inspect
from kvrelay.json_codec import loads

_KEY = b'"content":'
_JSON_SPACE = b" \t\r\n"
_DEFAULTS = tuple(EventInfo._field_defaults.values())  # the fields after the first six
MAX_LEARNED = 3  # skeletons learned per stream: an upstream whose deltas never repeat one stops paying


class _Skeleton(NamedTuple):
    head: bytes  # the event up to the text's opening quote
    tail: bytes  # the event after its closing quote


class DeltaReader:
    """inspect(), for the events of one stream, with its content deltas read by skeleton."""

    def __init__(self) -> None:
        self._skeleton: _Skeleton | None = None
        self._learned = 0

    def skeleton_text(self, event: bytes) -> str | None:
        """The text of a content delta made of the learned skeleton (all inspect() would
        find in it: EventInfo(bool(text), text, None, False, None, ())); None when the
        event needs inspect()."""
        skeleton = self._skeleton
        return None if skeleton is None else _text_in(event, skeleton)

    def inspect(self, event: bytes) -> EventInfo:
        if (text := self.skeleton_text(event)) is not None:
            return _info(text)
        return self.parsed(event)

    def parsed(self, event: bytes) -> EventInfo:
        """inspect() for an event skeleton_text() did not read: parsed in full, and its
        skeleton learned if it is a plain delta."""
        info = inspect(event)
        if info.text and self._learned < MAX_LEARNED and info == EventInfo(True, info.text, None, False, None, ()):
            self._learn(event)
        return info

    def _learn(self, event: bytes) -> None:
        """Keep the event's skeleton if the event is a plain delta that fits the proof above."""
        if not event.startswith(b"data:") or event.find(b"\n") != len(event) - 2 or b"\r" in event:
            return  # not one data line
        span = _string_after_key(event)
        if span is None:
            return
        head, tail = event[: span[0]], event[span[1]:]
        if b"\x00" in head or b"\x00" in tail:
            return
        text = _plain_text(event)
        if text is None or _decoded(event[span[0]:span[1]]) != text:
            return
        other = "a" if text != "a" else "b"
        if _plain_text(head + b'"' + other.encode() + b'"' + tail) != other:
            return  # the span is some other string: the delta's text does not follow it
        self._skeleton = _Skeleton(head, tail)
        self._learned += 1


def _text_in(event: bytes, skeleton: _Skeleton) -> str | None:
    """The text of an event made of `skeleton` around one JSON string; else None."""
    head, tail = skeleton
    end = len(event) - len(tail)
    if end - len(head) < 2 or not event.startswith(head) or not event.endswith(tail):
        return None
    return _decoded(event[len(head):end])


def _decoded(token: bytes) -> str | None:
    """The string a JSON string literal holds; None unless `token` is exactly one."""
    if token[:1] != b'"':
        return None
    try:
        literal = token.decode("utf-8", "surrogatepass")
        value, end = scanstring(literal, 1, True)  # strict, as json.loads: no raw control character
    except ValueError:  # invalid UTF-8, a bad escape, a control character, no closing quote
        return None
    return value if end == len(literal) else None  # not a second value after it


def _info(text: str) -> EventInfo:
    """EventInfo(bool(text), text, None, False, None, ()), built without its Python __new__
    (one call per event: the fast path's largest piece but for the string itself)."""
    return tuple.__new__(EventInfo, (bool(text), text, None, False, None, (), *_DEFAULTS))


def _string_after_key(event: bytes) -> tuple[int, int] | None:
    """Where the string literal after the first `"content":` starts and ends (quotes included)."""
    at = event.find(_KEY)
    if at < 0:
        return None
    start = at + len(_KEY)
    while start < len(event) and event[start] in _JSON_SPACE:
        start += 1
    if event[start:start + 1] != b'"':
        return None
    end = start
    while (end := event.find(b'"', end + 1)) >= 0:
        before = end - 1
        while event[before] == 0x5C:  # each run of backslashes is walked once: linear in the event
            before -= 1
        if (end - 1 - before) % 2 == 0:  # not escaped: the closing quote
            return start, end + 1
    return None


def _plain_text(event: bytes) -> str | None:
    """The text of a chat chunk that carries one choice's content and nothing else the
    gateway reads (no tool call, reasoning, finish reason, usage, error or engine report)."""
    data = b"".join(line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:"))
    try:
        body: Any = loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or isinstance(body.get("type"), str) \
            or any(isinstance(body.get(key), dict) for key in ("usage", "error", "kv_transfer_params")):
        return None
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choice := choices[0], dict):
        return None
    delta = choice.get("delta")
    if not isinstance(delta, dict) or isinstance(choice.get("finish_reason"), str) \
            or delta.get("tool_calls") or delta.get("reasoning_content"):
        return None
    text = delta.get("content")
    return text if isinstance(text, str) else None
