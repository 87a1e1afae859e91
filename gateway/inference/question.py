"""The user question inside another agent's template.

The first request of a session brings the question, often wrapped in that agent's
template ("You are the math expert. Solve: <question> Answer with a number."); the
gateway keeps the whole message as the question. When another agent's prompt wraps
the same question in its own template, the whole text is not found, but the question
is their longest common substring. `common_core` finds it, cut to whole words (a cut
inside a word would tokenize differently in each template), so the session's question
can be narrowed to what every agent actually shares.
"""

from __future__ import annotations

from difflib import SequenceMatcher
from typing import NamedTuple

MAX_COMPARED_CHARS = 8192  # the search is quadratic at worst: questions are short, prompts may not be


class CommonCore(NamedTuple):
    start: int  # in the known question
    end: int
    message_start: int  # where the same text starts in the new message


def common_core(question: str, message: str, min_chars: int, min_share: float = 0.5) -> CommonCore | None:
    """The longest whole-word text that `question` and `message` share, if it is at least
    `min_chars` long and `min_share` of the question; None otherwise."""
    if len(question) > MAX_COMPARED_CHARS:
        return None
    window = message[:MAX_COMPARED_CHARS]
    match = SequenceMatcher(None, question, window, autojunk=False).find_longest_match(
        0, len(question), 0, len(window))
    start, end = match.a, match.a + match.size
    while start < end and start > 0 and not question[start - 1].isspace():
        start += 1  # began inside a word
    while end > start and end < len(question) and not question[end].isspace():
        end -= 1  # ended inside a word
    while start < end and question[start].isspace():
        start += 1
    while end > start and question[end - 1].isspace():
        end -= 1
    if end - start < max(min_chars, min_share * len(question.strip())):
        return None
    return CommonCore(start, end, match.b + (start - match.a))
