"""The user question inside another agent's template.

The first request of a session brings the question, often wrapped in that agent's
template ("You are the math expert. Solve: <question> Answer with a number."); the
gateway keeps the whole message as the question. When another agent's prompt wraps
the same question in its own template, the whole text is not found, but the question
is their longest common text. `common_core` finds the longest whole-word part of the
question (a cut inside a word would tokenize differently in each template) that the
message contains, so the session's question can be narrowed to what every agent
actually shares.

In linear time, whatever the text: only a part at least `need` characters long counts
(`min_chars`, and `min_share` of the question), and any text that long holds one of the
question's windows of ceil(need / 2) characters that start at a multiple of that length
(a handful: about 2 / min_share). Each is looked for among all the message's windows by
hash (one numpy pass), and each place found is grown both ways to the longest common
text along that alignment, at C speed. The longest whole-word part of any of those is
the answer. Only text repetitive enough to hold one window at more than
MAX_PLACES_PER_WINDOW places is searched partly (the first places).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from kvrelay.gateway.inference.prefix import common_prefix_len
from kvrelay.gateway.inference.textindex import window_hashes

MAX_QUESTION_CHARS = 8192  # a longer first message is a document, not a question: not narrowed
MAX_MESSAGE_CHARS = 32768  # the question is looked for in the message's first so many characters
MAX_PLACES_PER_WINDOW = 16  # places in the message grown per window of the question

# Every code point str.isspace() calls whitespace (the same as regex \s).
_SPACES = np.array([0x9, 0xA, 0xB, 0xC, 0xD, 0x1C, 0x1D, 0x1E, 0x1F, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                    0x2028, 0x2029, 0x202F, 0x205F, 0x3000], dtype=np.uint32)


class CommonCore(NamedTuple):
    start: int  # in the known question
    end: int
    message_start: int  # where the same text starts in the new message


def common_core(question: str, message: str, min_chars: int, min_share: float = 0.5) -> CommonCore | None:
    """The longest whole-word text of `question` that `message` contains, if it is at
    least `min_chars` long and `min_share` of the question; None otherwise."""
    need = max(min_chars, math.ceil(min_share * len(question.strip())), 1)
    if len(question) > MAX_QUESTION_CHARS or need > len(question):
        return None
    window = message[:MAX_MESSAGE_CHARS]
    k = (need + 1) // 2  # every text of `need` characters holds a window of k starting at a multiple of k
    if len(window) < k:
        return None
    question_windows = window_hashes(question, k)[::k]
    message_windows = window_hashes(window, k)
    reversed_question, reversed_window = question[::-1], window[::-1]
    words: _Words | None = None  # built at the first place found
    best: tuple[int, int] | None = None  # (start, end) in the question
    grown: dict[int, tuple[int, int]] = {}  # alignment (message minus question offset) -> match found on it
    for n, digest in enumerate(question_windows):  # numpy scalars: compared exactly, as uint64
        at = n * k
        for place in np.flatnonzero(message_windows == digest)[:MAX_PLACES_PER_WINDOW].tolist():
            shift = place - at
            known = grown.get(shift)
            if known is not None and known[0] <= at < known[1]:
                continue  # this alignment was grown through this window already
            ahead = common_prefix_len(question, window, at, place)
            if ahead < k:
                continue  # a hash collision
            behind = common_prefix_len(reversed_question, reversed_window, len(question) - at, len(window) - place)
            grown[shift] = (at - behind, at + ahead)
            words = words or _Words(question)
            run = words.inside(at - behind, at + ahead)
            if run is not None and (best is None or _longer(run, best)):
                best = run
    if best is None or best[1] - best[0] < need:
        return None
    start, end = best
    return CommonCore(start, end, window.find(question[start:end]))


class _Words:
    """Where the words of a text start and end (numpy, once per text)."""

    def __init__(self, text: str) -> None:
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        word = ~np.isin(codes, _SPACES)
        edges = np.diff(np.concatenate(([False], word, [False])).astype(np.int8))
        self.starts = np.flatnonzero(edges == 1)  # first character of each word
        self.ends = np.flatnonzero(edges == -1)  # one past the last character of each word

    def inside(self, start: int, end: int) -> tuple[int, int] | None:
        """The longest run of whole words inside text[start:end], if any."""
        i = int(np.searchsorted(self.starts, start))
        j = int(np.searchsorted(self.ends, end, side="right")) - 1
        if i >= len(self.starts) or j < 0 or self.starts[i] >= self.ends[j]:
            return None
        return int(self.starts[i]), int(self.ends[j])


def _longer(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Longer, or as long and earlier in the question."""
    return (a[1] - a[0], -a[0]) > (b[1] - b[0], -b[0])
