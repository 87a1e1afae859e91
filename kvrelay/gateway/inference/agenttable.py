"""AgentTable: the agents of one app, bounded and indexed, so that a request finds its
agent without comparing its system prompt with every agent's.

Bounded: at most `capacity` agents stay in memory, the least recently used leaving first
(counted as `agents_evicted`, and the owner is told so its step graph forgets the agent
too). An evicted agent that comes back is learned again; its row in SQL stays as last
saved.

Indexed: agents.py's rule says a system prompt belongs to a known agent of its model when
their common prefix is at least the agent's *threshold*, max(min_chars, ceil(ratio *
len(candidate))) characters. That holds exactly when the prompt starts with the
candidate's first `threshold` characters, so each agent is filed under that head (cut to
HEAD_CHARS): a prompt finds its candidates with one dict lookup per distinct head length
(at most HEAD_CHARS of them), and compares at most MAX_COMPARED candidates in full. Apps
whose agents share a preamble longer than HEAD_CHARS are the only ones that can reach
that cap (counted as `agent_matches_cut`); the agents compared are then the most
recently filed.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from kvrelay.gateway.inference.prefix import PrefixLearner, common_prefix_len

HEAD_CHARS = 256  # the longest head an agent is filed under: bounds the lookups per prompt
MAX_COMPARED = 32  # candidates compared in full per prompt


@dataclass
class AgentState:
    id: str
    model: str
    prefix: PrefixLearner
    name: str | None = None  # what the traffic calls it (a message `name` on its quoted outputs), once seen
    composed_reads: int = 0  # requests of its passes that read a composed view of outputs (rounds.py)
    transcript_reads: int = 0  # ... that read a transcript

    def expects_rounds(self) -> bool:
        return self.composed_reads > 0 and 2 * self.composed_reads >= self.transcript_reads


class AgentTable(Mapping[str, AgentState]):
    def __init__(self, capacity: int, same_agent_ratio: float, on_evict: Callable[[str], None],
                 bounded: Counter[str]) -> None:
        self.capacity = capacity
        self.ratio = same_agent_ratio
        self._on_evict = on_evict
        self.bounded = bounded
        self._agents: OrderedDict[str, AgentState] = OrderedDict()  # least recently used first
        self._serial: dict[str, int] = {}  # order of learning: the first learned wins a tie
        self._next_serial = 0
        self._filed: dict[str, tuple[str, str]] = {}  # agent -> (model, head) it is filed under
        self._heads: dict[tuple[str, str], dict[str, None]] = {}  # (model, head) -> agents, oldest filed first
        self._lengths: dict[str, Counter[int]] = {}  # model -> head length -> agents filed with it
        self._longest_first: dict[str, list[int]] = {}  # model -> its head lengths, longest first

    # -- Mapping ------------------------------------------------------------------------
    def __getitem__(self, agent_id: str) -> AgentState:
        return self._agents[agent_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._agents)

    def __len__(self) -> int:
        return len(self._agents)

    # -- use --------------------------------------------------------------------------------
    def use(self, agent_id: str, model: str, new_learner: Callable[[], PrefixLearner]) -> AgentState:
        """The agent (learned now if unknown), as the most recently used."""
        agent = self._agents.get(agent_id)
        if agent is None:
            self.add(AgentState(agent_id, model, new_learner()))
            return self._agents[agent_id]
        self._agents.move_to_end(agent_id)
        return agent

    def add(self, agent: AgentState) -> None:
        """Take in an agent (new, or rebuilt from SQL) as the most recently used; past
        `capacity`, the least recently used leaves."""
        if agent.id in self._agents:
            self._unfile(agent.id)
        else:
            self._serial[agent.id] = self._next_serial
            self._next_serial += 1
        self._agents[agent.id] = agent
        self._agents.move_to_end(agent.id)
        self.refile(agent)
        while len(self._agents) > self.capacity:
            self._evict(next(iter(self._agents)))

    def refile(self, agent: AgentState) -> None:
        """File the agent under its current head (its candidate prefix may have changed)."""
        key = self._head(agent)
        if self._filed.get(agent.id) == key:
            return
        self._unfile(agent.id)
        if key is None:
            return
        self._filed[agent.id] = key
        self._heads.setdefault(key, {})[agent.id] = None
        lengths = self._lengths.setdefault(key[0], Counter())
        lengths[len(key[1])] += 1
        if lengths[len(key[1])] == 1:
            self._longest_first.pop(key[0], None)

    def match(self, model: str, system_text: str) -> AgentState | None:
        """The known agent of `model` whose candidate prefix shares the most with
        `system_text`, among those sharing at least their threshold; None if none does."""
        best: AgentState | None = None
        best_rank = (0, 0)
        compared = 0
        for length in self._lengths_of(model):
            if length > len(system_text):
                continue
            for agent_id in reversed(self._heads.get((model, system_text[:length]), {})):
                if compared == MAX_COMPARED:
                    self.bounded["agent_matches_cut"] += 1
                    return best
                compared += 1
                agent = self._agents[agent_id]
                candidate = agent.prefix.candidate or ""
                chars = common_prefix_len(candidate, system_text)
                rank = (chars, -self._serial[agent_id])
                if chars >= self._threshold(agent, candidate) and (best is None or rank > best_rank):
                    best, best_rank = agent, rank
        return best

    # -- inside -------------------------------------------------------------------------------
    def _threshold(self, agent: AgentState, candidate: str) -> int:
        return max(agent.prefix.min_chars, math.ceil(self.ratio * len(candidate)))

    def _head(self, agent: AgentState) -> tuple[str, str] | None:
        """(model, head) the agent is filed under; None while it cannot match any prompt
        (no candidate yet, or one shorter than min_chars)."""
        candidate = agent.prefix.candidate
        if candidate is None or len(candidate) < agent.prefix.min_chars:
            return None
        return agent.model, candidate[:min(self._threshold(agent, candidate), HEAD_CHARS)]

    def _lengths_of(self, model: str) -> list[int]:
        lengths = self._longest_first.get(model)
        if lengths is None:
            lengths = self._longest_first[model] = sorted(self._lengths.get(model, {}), reverse=True)
        return lengths

    def _unfile(self, agent_id: str) -> None:
        key = self._filed.pop(agent_id, None)
        if key is None:
            return
        bucket = self._heads[key]
        del bucket[agent_id]
        if not bucket:
            del self._heads[key]
        lengths = self._lengths[key[0]]
        lengths[len(key[1])] -= 1
        if lengths[len(key[1])] == 0:
            del lengths[len(key[1])]
            self._longest_first.pop(key[0], None)

    def _evict(self, agent_id: str) -> None:
        self._unfile(agent_id)
        del self._agents[agent_id]
        del self._serial[agent_id]
        self.bounded["agents_evicted"] += 1
        self._on_evict(agent_id)
