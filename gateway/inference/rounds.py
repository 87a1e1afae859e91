"""RoundDetector: All-Gather rounds from the outputs each request reads.

In an All-Gather round (TokenDance), every agent of the round reads the same set of
outputs of the previous round, each in its own prompt and order. So requests of one
session whose prompts hold the same set of at least two earlier responses form a round.
Its expected size is the size the previous round reached (at the first round: the
number of outputs read, one per agent in the usual all-to-all pattern); a request's
index is its arrival order within the round.

A request reading a set nobody has read before may open a round or may just be an
agent that reads several others (a reviewer after two writers, an agent of a
fully-connected swarm reading this round's earlier answers). Only the next request
tells. The first reader is therefore announced as a round member only where the app
has shown rounds more often than lone readers (`RoundEvidence`, per app, learned as
rounds close); a second reader of the same set always confirms the round. A false round
costs more than a missed first member: a round hold would wait for nobody, while the
engine still finds a missed member's shared outputs by their hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_ext.protocol import RoundInfo

MIN_SHARED_OUTPUTS = 2


@dataclass
class RoundEvidence:
    """Per app: how the sets read by several requests turned out when they closed."""

    num_rounds: int = 0  # read by two requests or more (counted when the second arrives)
    num_lone: int = 0  # read by one request only (counted when the session moves on)

    def expects_rounds(self) -> bool:
        return self.num_rounds > self.num_lone


@dataclass
class RoundState:
    id: str
    expected: int
    num_requests: int = 0


@dataclass
class RoundDetector:
    session_id: str
    evidence: RoundEvidence = field(default_factory=RoundEvidence)
    rounds: dict[frozenset[int], RoundState] = field(default_factory=dict)
    last_size: int | None = None  # how many requests the latest round had
    unsaved: set[frozenset[int]] = field(default_factory=set)  # rounds changed since the last save to SQL
    _current: frozenset[int] | None = None

    @property
    def current(self) -> RoundState | None:
        """The latest set read (the one a new request most likely joins)."""
        return self.rounds[self._current] if self._current is not None else None

    def restore_current(self, round_id: str | None) -> None:
        self._current = next((k for k, r in self.rounds.items() if r.id == round_id), None)

    def assign(self, outputs_read: frozenset[int]) -> RoundInfo | None:
        """The round of a request that read these outputs (their text seqs), or None."""
        if len(outputs_read) < MIN_SHARED_OUTPUTS:
            return None
        state = self.rounds.get(outputs_read)
        if state is None:
            self._close_current()
            expected = self.last_size or len(outputs_read)
            state = self.rounds[outputs_read] = RoundState(f"{self.session_id}/r{len(self.rounds) + 1}", expected)
            self._current = outputs_read
        index = state.num_requests
        state.num_requests += 1
        self.unsaved.add(outputs_read)
        if index == 1:
            self.evidence.num_rounds += 1  # confirmed now: other sessions of the app need not wait for it to close
        if index == 0 and not self.evidence.expects_rounds():
            return None  # a lone reader, until a second one shows otherwise
        return RoundInfo(id=state.id, size=max(state.expected, state.num_requests), index=index)

    def _close_current(self) -> None:
        if self._current is None:
            return
        size = self.rounds[self._current].num_requests
        if size >= 2:
            self.last_size = size
        else:
            self.evidence.num_lone += 1
