"""PrefixLearner: the fixed part of one agent's system prompt, learned online.

KVFlow's heuristic: a prefix that keeps hitting is fixed. The learner keeps a
candidate (at first the whole system prompt) and shrinks it to the common prefix with
each new prompt of the agent, cut back to a whitespace boundary so a fixed prefix never
ends inside a word (which would split a token differently when the tail changes). The
candidate is fixed once `min_hits` prompts in a row started with it. An explicit
delimiter ends the fixed part at once, with no learning.

Every comparison runs at C speed (str.startswith on halving blocks, a regex for the
last whitespace): system prompts may be tens of thousands of characters, and a
character loop in Python over one of them would cost milliseconds per request.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_TO_LAST_SPACE = re.compile(r".*\s", re.DOTALL)  # greedy: ends just after the last whitespace


class PrefixObservation(NamedTuple):
    fixed_chars: int  # length of the fixed prefix of this prompt (0: none known yet)
    changed: bool  # the candidate moved (shrank, or was replaced)


class PrefixLearner:
    def __init__(self, min_hits: int = 2, min_chars: int = 16, delimiters: tuple[str, ...] = ()) -> None:
        self.min_hits = min_hits
        self.min_chars = min_chars
        self.delimiters = delimiters
        self.candidate: str | None = None
        self.hits = 0

    @property
    def fixed(self) -> str | None:
        """The learned fixed prefix, once it is stable."""
        if self.candidate is not None and self.hits >= self.min_hits and len(self.candidate) >= self.min_chars:
            return self.candidate
        return None

    def common_chars(self, prompt: str) -> int:
        """How much of `prompt` the candidate covers (for telling agents apart)."""
        if self.candidate is None:
            return 0
        return common_prefix_len(self.candidate, prompt)

    def observe(self, prompt: str) -> PrefixObservation:
        explicit = self._delimited(prompt)
        if explicit is not None:
            changed = explicit != self.candidate
            self.candidate, self.hits = explicit, self.min_hits
            return PrefixObservation(len(explicit), changed)
        if self.candidate is None:
            self.candidate, self.hits = prompt, 1
            return PrefixObservation(0, True)
        if prompt.startswith(self.candidate):
            self.hits += 1
            end = len(self.candidate)
            if 0 < end < len(prompt) and not prompt[end - 1].isspace() and not prompt[end].isspace():
                self.candidate = prompt[:_word_boundary(prompt, end)]  # it ended inside this prompt's word
                return PrefixObservation(len(self.candidate) if self.fixed else 0, True)
            return PrefixObservation(end if self.fixed else 0, False)
        common = _word_boundary(prompt, common_prefix_len(self.candidate, prompt))
        self.candidate, self.hits = prompt[:common], 2  # this prompt and the ones before share it
        return PrefixObservation(common if self.fixed else 0, True)

    def _delimited(self, prompt: str) -> str | None:
        for delimiter in self.delimiters:
            at = prompt.find(delimiter)
            if at >= 0:
                return prompt[: at + len(delimiter)]
        return None


def common_prefix_len(a: str, b: str, i: int = 0, j: int = 0) -> int:
    """Length of the longest common prefix of a[i:] and b[j:] (neither is copied): one C
    comparison, then on a mismatch a binary search where each step compares only the
    block not yet known to match. The blocks halve, so the work is linear in the shorter
    text at C speed, in a logarithmic number of Python steps."""
    n = max(0, min(len(a) - i, len(b) - j))
    if a.startswith(b[j:j + n], i):
        return n
    lo, hi = 0, n  # a[i:i+lo] == b[j:j+lo]; a[i:i+hi] != b[j:j+hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.startswith(b[j + lo:j + mid], i + lo):
            lo = mid
        else:
            hi = mid
    return lo


def _word_boundary(text: str, end: int) -> int:
    """Cut back to just after the last whitespace at or before `end` (or to `end` when
    `text` itself ends there)."""
    if end >= len(text):
        return end
    last = _TO_LAST_SPACE.match(text, 0, end)
    return last.end() if last is not None else 0
