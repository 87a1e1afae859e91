"""The user question inside the app's own template, learned across sessions.

An app often wraps each run's task in fixed wording: "The task is: <task>\\n", "News
in the village: <task>\\nIt is 8:00 am. State your plan...". Inside one session nothing
tells the wording from the task when every agent sends the same message. Across
sessions it does: the task changes, the wording does not. So the app's recent
session-opening messages are kept, and a new one is compared with each: their common
head and common tail are the template, what lies between is the question.

A shared head or tail counts only up to a clause boundary (a line break, or a space
after `:` `.` `;` `?` `!`): two tasks that merely begin alike ("What is the weather in
Rome?", "What is your shipping policy?") share "What is ", which ends inside a clause,
so neither loses it. Of all earlier openings, the one that explains the most of the new
message as template wins; with none, the whole message (stripped) is the question.

Bounded: at most `keep` openings per app, each compared once at C speed
(common_prefix_len), and only messages up to MAX_CHARS characters.
"""

from __future__ import annotations

import re
from collections import deque
from typing import NamedTuple

from kvrelay.gateway.inference.prefix import common_prefix_len

MAX_CHARS = 8192  # a longer opening is a document: taken whole
_HEAD_END = re.compile(r"(?:\n|[:.;?!][ \t])[ \t]*")  # a clause boundary: the head may end right after one
_TAIL_START = re.compile(r"\n|(?<=[:.;?!])[ \t]")  # ... and the tail may start at one


class Span(NamedTuple):
    start: int
    end: int


class Question(NamedTuple):
    span: Span  # in the new message
    earlier: tuple[str, str] | None  # (session, its question) of the opening that showed the template


class OpeningTemplates:
    def __init__(self, keep: int = 8) -> None:
        self._openings: deque[tuple[str, str]] = deque(maxlen=keep)  # (message, session), most recent last

    def question(self, message: str) -> Question:
        """Where the question lies in a session's opening message (stripped, never empty
        for a message with any text), and where it lies in the earlier opening that
        showed the template: that session's question can now be narrowed too."""
        best = Question(_strip(message, 0, len(message)), None)
        if len(message) > MAX_CHARS:
            return best
        explained = 0
        for earlier, session_id in self._openings:
            if earlier == message:
                continue  # the same task again: says nothing about the wording
            head = _head(message, common_prefix_len(message, earlier))
            tail = _tail(message, common_prefix_len(message[::-1], earlier[::-1]), head)
            span = _strip(message, head, len(message) - tail)
            if head + tail > explained and span.end > span.start:
                explained = head + tail
                inside = _strip(earlier, head, len(earlier) - tail)
                best = Question(span, (session_id, earlier[inside.start:inside.end]))
        return best

    def remember(self, message: str, session_id: str) -> None:
        if len(message) > MAX_CHARS or any(message == m for m, _ in self._openings):
            return
        self._openings.append((message, session_id))


def _head(message: str, shared: int) -> int:
    """The longest head of `message` within its first `shared` characters that ends at a clause boundary."""
    end = 0
    for boundary in _HEAD_END.finditer(message, 0, shared):
        end = boundary.end()
    return end


def _tail(message: str, shared: int, head: int) -> int:
    """The longest tail of `message` within its last `shared` characters (and after
    `head`) that starts at a clause boundary, as a length."""
    start = max(len(message) - shared, head)
    boundary = _TAIL_START.search(message, start)
    return len(message) - boundary.start() if boundary is not None else 0


def _strip(text: str, start: int, end: int) -> Span:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return Span(start, end)
