"""WorkflowTable: what the engine knows of the workflows it serves (KVFlow).

Per agent (app, agent id), the hashes of its fixed prefix's full blocks, learned from
its requests (the plan's fixed_prefix segment), and its latest steps-to-execution,
from the plan's step graph. A block's priority is the smallest steps-to-execution of
the agents whose prefix holds it, over every app: a shared node is kept as long as any
agent, in any workflow, needs it soon. Blocks in no prefix have no priority.

An agent whose request just finished ran a moment ago: until a newer plan of its app
says otherwise, it is placed after every other agent of the app (KVFlow's point: the
agent that just ran is the least likely to run next). An app that sent nothing for
`idle_s` seconds is forgotten, so a finished workflow stops holding its prefixes ahead
of everyone else's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple


class AgentKey(NamedTuple):
    app_id: str
    agent_id: str


class UpcomingAgent(NamedTuple):
    steps: int
    agent: AgentKey
    prefix: tuple[bytes, ...]


class WorkflowTable:
    def __init__(self, idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self._clock = clock
        self._prefixes: dict[AgentKey, tuple[bytes, ...]] = {}
        self._steps: dict[str, dict[str, int]] = {}  # app -> agent -> steps-to-execution
        self._last_seen: dict[str, float] = {}  # app -> when its last request arrived
        self._priorities: dict[bytes, float] | None = None  # cache, rebuilt after a change

    def observe(self, agent: AgentKey, prefix: tuple[bytes, ...] | None,
                steps: Mapping[str, int] | None) -> None:
        """A request of `agent` arrived: its fixed prefix's block hashes (None: unknown)
        and its plan's steps-to-execution for the app's agents (None: no step graph)."""
        self.expire()
        if prefix:
            self._prefixes[agent] = prefix
        if steps is not None:
            self._steps[agent.app_id] = dict(steps)
        self._last_seen[agent.app_id] = self._clock()
        self._priorities = None

    def expire(self) -> None:
        """Forget the apps that sent nothing for `idle_s` seconds."""
        cutoff = self._clock() - self.idle_s
        idle = {app for app, seen in self._last_seen.items() if seen < cutoff}
        if not idle:
            return
        for app in idle:
            del self._last_seen[app]
            self._steps.pop(app, None)
        self._prefixes = {agent: p for agent, p in self._prefixes.items() if agent.app_id not in idle}
        self._priorities = None

    def finished(self, agent: AgentKey) -> None:
        """`agent`'s request finished: it goes to the back of its app's queue."""
        steps = self._steps.get(agent.app_id)
        if steps is None:
            return
        others = [s for a, s in steps.items() if a != agent.agent_id]
        steps[agent.agent_id] = max(others, default=0) + 1
        self._priorities = None

    def steps(self, agent: AgentKey) -> float:
        """Steps until `agent` runs; infinity when no plan says."""
        return self._steps.get(agent.app_id, {}).get(agent.agent_id, math.inf)

    def priority(self, block_hash: bytes) -> float | None:
        """The smallest steps-to-execution among agents whose fixed prefix holds the block."""
        if self._priorities is None:
            self._priorities = self._propagate()
        return self._priorities.get(block_hash)

    def agents(self) -> dict[AgentKey, tuple[float, int]]:
        """Every agent seen with a fixed prefix: its steps-to-execution and prefix blocks."""
        return {agent: (self.steps(agent), len(prefix)) for agent, prefix in self._prefixes.items()}

    def upcoming(self, load_ahead: int) -> list[UpcomingAgent]:
        """Agents with a known prefix due within `load_ahead` steps, soonest first."""
        self.expire()
        due = [UpcomingAgent(int(steps), agent, prefix) for agent, prefix in self._prefixes.items()
               if (steps := self.steps(agent)) <= load_ahead]
        return sorted(due)

    def _propagate(self) -> dict[bytes, float]:
        """Each block takes the minimum over the agents using it; a prefix's earlier blocks
        are its ancestors in the cache tree, so this is KVFlow's upward propagation."""
        priorities: dict[bytes, float] = {}
        for agent, prefix in self._prefixes.items():
            steps = self.steps(agent)
            for block_hash in prefix:
                priorities[block_hash] = min(steps, priorities.get(block_hash, math.inf))
        return priorities
