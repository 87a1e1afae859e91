"""PrefixLearner: the fixed part of one agent's system prompt, learned online.

KVFlow's heuristic: a prefix that keeps hitting is fixed. The learner keeps a
candidate (at first the whole system prompt) and shrinks it to the common prefix with
each new prompt of the agent, cut back to a whitespace boundary so a fixed prefix never
ends inside a word (which would split a token differently when the tail changes). The
candidate is fixed once `min_hits` prompts in a row started with it. An explicit
delimiter ends the fixed part at once, with no learning.
"""

from __future__ import annotations

import os
from typing import NamedTuple


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
        return len(os.path.commonprefix([self.candidate, prompt]))

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
        common = _word_boundary(prompt, len(os.path.commonprefix([self.candidate, prompt])))
        self.candidate, self.hits = prompt[:common], 2  # this prompt and the ones before share it
        return PrefixObservation(common if self.fixed else 0, True)

    def _delimited(self, prompt: str) -> str | None:
        for delimiter in self.delimiters:
            at = prompt.find(delimiter)
            if at >= 0:
                return prompt[: at + len(delimiter)]
        return None


def _word_boundary(text: str, end: int) -> int:
    """Cut back to just after the last whitespace at or before `end` (or to `end` when
    `text` itself ends there)."""
    if end >= len(text):
        return end
    cut = end
    while cut > 0 and not text[cut - 1].isspace():
        cut -= 1
    return cut
