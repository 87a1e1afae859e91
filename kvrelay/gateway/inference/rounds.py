"""RoundDetector: the rounds of a session, as passes in which each agent speaks once.

Apps that work in rounds (KVCOMM's debate, Generative Agents' All-Gather) compose each
prompt: the task, then a view of the other agents' outputs chosen by round (this
round's earlier answers and the others' last ones; everyone's answers of the previous
round, in each agent's own order). A chat transcript (a group chat, a pipeline, a tool
loop) only ever appends: its prompts read outputs in the order they were produced, and
every output of each agent they read. So a request that reads outputs out of their
order, or the same outputs as another request of its pass, leaving older ones out (an
All-Gather round's agents all read the last round), shows a `composed` view; one that reads in order the outputs
of agents of which one has spoken twice shows a `transcript` (read_pattern: a loop that
reads an agent's latest attempt, a window over a transcript, read in order). Both count for every agent of
the current pass, and an agent expects rounds while its composed views are at least
half as many as its transcripts. A first session's first rounds are missed.

A round is a pass: it ends when an agent that has already asked in it asks again, and
the next pass begins with that request. A request is a round member when it reads
outputs of its session and its agent expects rounds; its index is its arrival order in
the round, the expected size the number of agents of the previous pass. A round that
only ever had one member did not form: the admin views show formed rounds only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvrelay.wire.plan import RoundInfo

ReadPattern = Literal["composed", "transcript"]


def read_pattern(outputs_read: Sequence[int], producer: Mapping[int, str | None],
                 series: Mapping[str, Sequence[int]], read_in_pass: bool = False) -> ReadPattern | None:
    """What reading these outputs (seqs, in prompt order) shows: `composed` when they are
    out of order, or when another request of the pass read the same ones, outputs of two
    agents or more leaving an older one out (an All-Gather round's agents all read the
    last round; a speaker and the chat's speaker selector both read the whole transcript);
    `transcript` when they are in order and one of their agents has spoken twice; else
    nothing (an agent's first outputs read in order fit both). `producer`: seq -> its
    agent; `series`: agent -> its outputs' seqs."""
    if any(b < a for a, b in zip(outputs_read, outputs_read[1:])):
        return "composed"
    read = set(outputs_read)
    agents = {producer.get(seq) or "" for seq in read}
    latest_only = any(not read.issuperset(series.get(agent, ())) for agent in agents)
    if read_in_pass and len(agents) >= 2 and latest_only:
        return "composed"
    spoke_again = any(len(series.get(agent, ())) >= 2 for agent in agents)
    return "transcript" if spoke_again else None


@dataclass
class RoundState:
    id: str
    expected: int
    num_requests: int = 0
    reads: frozenset[int] = frozenset()  # the outputs its members read

    @property
    def formed(self) -> bool:
        return self.num_requests >= 2


@dataclass
class RoundDetector:
    session_id: str
    rounds: dict[str, RoundState] = field(default_factory=dict)  # by id, oldest first
    pass_agents: set[str] = field(default_factory=set)  # agents that asked in the current pass
    pass_reads: set[frozenset[int]] = field(default_factory=set)  # the output sets read in the current pass
    last_pass: set[str] = field(default_factory=set)  # agents of the previous pass
    current_id: str | None = None  # the current pass's round, once it has a member
    unsaved: set[str] = field(default_factory=set)  # round ids changed since the last save to SQL

    def rest_of_round(self) -> set[str]:
        """Agents of the previous pass that have not asked in this one yet: in a round
        app they are the round's members still to come."""
        return self.last_pass - self.pass_agents

    @property
    def current(self) -> RoundState | None:
        return self.rounds.get(self.current_id) if self.current_id is not None else None

    def formed(self) -> list[RoundState]:
        return [r for r in self.rounds.values() if r.formed]

    def enter(self, agent_id: str) -> None:
        """A request of this agent arrives: the pass goes on, or a new one begins with it."""
        if agent_id in self.pass_agents:
            self.last_pass, self.pass_agents, self.current_id = self.pass_agents, set(), None
            self.pass_reads = set()
        self.pass_agents.add(agent_id)

    def read_before(self, outputs_read: frozenset[int]) -> bool:
        """Whether another request of this pass read these outputs; they count as read now."""
        seen = outputs_read in self.pass_reads
        self.pass_reads.add(outputs_read)
        return seen

    def join(self, outputs_read: frozenset[int], expects_rounds: bool) -> RoundInfo | None:
        """The round of the request that just entered; None when it is no round member."""
        if not outputs_read or not expects_rounds:
            return None
        state = self.current
        if state is None:
            state = RoundState(f"{self.session_id}/r{len(self.rounds) + 1}", len(self.last_pass or self.pass_agents))
            self.rounds[state.id] = state
            self.current_id = state.id
        index = state.num_requests
        state.num_requests += 1
        state.reads |= outputs_read
        self.unsaved.add(state.id)
        return RoundInfo(id=state.id, size=max(state.expected, state.num_requests), index=index)
