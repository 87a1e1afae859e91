"""RoundDetector: All-Gather rounds from the outputs each request reads.

In an All-Gather round (TokenDance), every agent of the round reads the same set of
outputs of the previous round, each in its own prompt and order. So requests of one
session whose prompts hold the same set of at least two earlier responses form a round.
Its expected size is the size the previous round reached (at the first round: the
number of outputs read, one per agent in the usual all-to-all pattern); a request's
index is its arrival order within the round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_ext.protocol import RoundInfo

MIN_SHARED_OUTPUTS = 2


@dataclass
class RoundState:
    id: str
    expected: int
    num_requests: int = 0


@dataclass
class RoundDetector:
    session_id: str
    rounds: dict[frozenset[int], RoundState] = field(default_factory=dict)
    last_size: int | None = None  # how many requests the latest finished round had
    unsaved: set[frozenset[int]] = field(default_factory=set)  # rounds changed since the last save to SQL
    _current: frozenset[int] | None = None

    @property
    def current(self) -> RoundState | None:
        """The latest round (the one a new request most likely joins)."""
        return self.rounds[self._current] if self._current is not None else None

    def restore_current(self, round_id: str | None) -> None:
        self._current = next((k for k, r in self.rounds.items() if r.id == round_id), None)

    def assign(self, outputs_read: frozenset[int]) -> RoundInfo | None:
        """The round of a request that read these outputs (their text seqs), or None."""
        if len(outputs_read) < MIN_SHARED_OUTPUTS:
            return None
        state = self.rounds.get(outputs_read)
        if state is None:
            if self._current is not None:
                self.last_size = self.rounds[self._current].num_requests
            expected = self.last_size or len(outputs_read)
            state = self.rounds[outputs_read] = RoundState(f"{self.session_id}/r{len(self.rounds) + 1}", expected)
            self._current = outputs_read
        index = state.num_requests
        state.num_requests += 1
        self.unsaved.add(outputs_read)
        return RoundInfo(id=state.id, size=max(state.expected, state.num_requests), index=index)
