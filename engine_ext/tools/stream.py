"""Reading an answer while it streams: release content as soon as it cannot be part of
a tool call, hold back what may be, and read the calls once the answer is complete.

Released content is never withdrawn: a stream holds back from the first place a call
may begin (a marker, or a prefix of one at the end of the text so far), and at the end
sends the rest of the content the finished answer has. Calls go out whole at the end,
each with its id, name and complete arguments in one delta, which every OpenAI client
accumulates like a split one.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from engine_ext.tools.calls import ParsedAnswer, ToolCall

if TYPE_CHECKING:
    from engine_ext.tools.formats.base import Reading, ToolFormat


class AnswerStream(ABC):
    """Fed the whole answer so far after each step; says what content to send now."""

    def __init__(self, fmt: ToolFormat, reading: Reading) -> None:
        self.format = fmt
        self.reading = reading
        self.released = ""  # content sent so far

    @abstractmethod
    def _safe(self, text: str) -> str:
        """The content of `text` (the answer so far) that no later token can make part of a call."""

    def feed(self, text: str) -> str:
        """New content to send, given the answer so far."""
        return self._release(self._safe(text))

    def finish(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """The content still to send and the calls, once the answer is complete."""
        parsed = self.parse(text)
        return self._release(parsed.content or ""), parsed.calls

    def parse(self, text: str) -> ParsedAnswer:
        return self.format.parse(text, self.reading)

    def _release(self, content: str) -> str:
        if not content.startswith(self.released):
            return ""  # cannot happen: content only grows as a prefix of the answer's
        delta, self.released = content[len(self.released):], content
        return delta


class MarkerStream(AnswerStream):
    """Calls open with a marker that may follow text (Hermes' `<tool_call>`). Trailing
    whitespace is held too: before a call, whitespace alone is no content."""

    def __init__(self, fmt: ToolFormat, reading: Reading, marker: str) -> None:
        super().__init__(fmt, reading)
        self.marker = marker

    def _safe(self, text: str) -> str:
        found = text.find(self.marker)
        if found >= 0:
            return text[:found].rstrip()
        for k in range(min(len(text), len(self.marker) - 1), 0, -1):
            if self.marker.startswith(text[-k:]):
                return text[:-k].rstrip()
        return text.rstrip()


class LeadingStream(AnswerStream):
    """Calls, when there are any, are the whole answer and open with one of `openers`
    (Llama 3's `{`, Mistral's `[TOOL_CALLS]`): the answer is held until its first
    characters decide, then streams as content if it is not a call."""

    def __init__(self, fmt: ToolFormat, reading: Reading, openers: tuple[str, ...]) -> None:
        super().__init__(fmt, reading)
        self.openers = openers

    def _safe(self, text: str) -> str:
        head = text.lstrip()
        if not head or any(o.startswith(head) or head.startswith(o) for o in self.openers):
            return ""
        return text


class JsonFieldStream(AnswerStream):
    """The answer is a JSON object whose string field is the content (the generic
    format's {"response": "..."}): the string streams as it is decoded. Without a
    prefix (the field holds JSON, not a string) the content goes out at the end.

    The scan for where the string's complete part ends resumes where the last step left
    it, so a long answer costs linear Python work, not a rescan per token."""

    def __init__(self, fmt: ToolFormat, reading: Reading, prefix: str | None) -> None:
        super().__init__(fmt, reading)
        self.prefix = prefix  # the object's text up to the string's opening quote
        self._end = 0  # how far into the string's body the complete part is known to reach

    def _safe(self, text: str) -> str:
        if self.prefix is None or not text.startswith(self.prefix):
            return ""
        body = text[len(self.prefix):]
        self._end = _string_end(body, self._end)
        return _decoded(body[:self._end])


def decoded_prefix(body: str) -> str:
    """The decoded text of a JSON string's body as far as it is complete: up to the
    closing quote, and short of an escape sequence still being written."""
    return _decoded(body[:_string_end(body, 0)])


def _string_end(body: str, start: int) -> int:
    """Where the complete part of a JSON string's body ends, scanning from `start` (a
    character or escape boundary): at the closing quote, or before an unfinished escape."""
    i = start
    while i < len(body):
        char = body[i]
        if char == '"':
            return i
        if char == "\\":
            width = 6 if body[i + 1:i + 2] == "u" else 2
            if i + width > len(body):
                return i
            i += width
            continue
        i += 1
    return len(body)


def _decoded(body: str) -> str:
    try:
        text: str = json.loads(f'"{body}"')  # a JSON string literal parses to a str
    except ValueError:  # not valid JSON string text: nothing is safe to send
        return ""
    if text and "\ud800" <= text[-1] <= "\udbff":
        text = text[:-1]  # the first half of a surrogate pair: wait for the second
    return text
