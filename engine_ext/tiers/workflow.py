"""WorkflowTable: what the engine knows of the workflows it serves (KVFlow).

Per agent (app, agent id), the hashes of its fixed prefix's full blocks, learned from
its requests (the plan's fixed_prefix segment). Steps-to-execution are kept per workflow
instance (app, session) by WorkflowSessions (sessions.py): an agent's steps are the
minimum over the live sessions of its app that will run it. A block's priority is the
smallest steps of the agents whose prefix holds it, over every app: a shared node is
kept as long as any agent, in any workflow instance, needs it soon. Blocks in no prefix
have no priority.

An agent whose request just finished ran a moment ago: until a newer plan of that session
says otherwise, it is placed after every other agent of the session. A session silent
for `idle_s` seconds is forgotten; an app with no live session left loses its agents'
prefixes, so a finished workflow stops holding them ahead of everyone else's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from engine_ext.tiers.sessions import DEFAULT_SESSION, SessionKey, WorkflowSessions


class AgentKey(NamedTuple):
    app_id: str
    agent_id: str


class UpcomingAgent(NamedTuple):
    steps: int
    agent: AgentKey
    prefix: tuple[bytes, ...]


class WorkflowTable:
    def __init__(self, idle_s: float = 600.0, max_sessions: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sessions = WorkflowSessions(idle_s, max_sessions, clock)
        self._prefixes: dict[AgentKey, tuple[bytes, ...]] = {}
        self._priorities: dict[bytes, float] | None = None  # cache, rebuilt after a change

    def observe(self, agent: AgentKey, prefix: tuple[bytes, ...] | None,
                steps: Mapping[str, int] | None, session: str | None = None) -> None:
        """A request of `agent` arrived in `session` (None: the app's one unnamed
        session): its fixed prefix's block hashes (None: unknown) and its plan's
        steps-to-execution for the app's agents, from that session's position (None: no
        step graph)."""
        self.expire()
        if prefix:
            self._prefixes[agent] = prefix
        gone = self.sessions.observe(SessionKey(agent.app_id, session or DEFAULT_SESSION), steps)
        self._forget_apps(gone)
        self._priorities = None

    def expire(self) -> None:
        """Forget the sessions that sent nothing for `idle_s` seconds, and the prefixes of
        apps left with none."""
        num_sessions = len(self.sessions)
        gone = self.sessions.expire()
        if len(self.sessions) != num_sessions:  # a session's steps no longer count
            self._forget_apps(gone)
            self._priorities = None

    def finished(self, agent: AgentKey, session: str | None = None) -> None:
        """`agent`'s request in `session` finished: it goes to the back of that session's queue."""
        if self.sessions.finished(SessionKey(agent.app_id, session or DEFAULT_SESSION), agent.agent_id):
            self._priorities = None

    def steps(self, agent: AgentKey) -> float:
        """Steps until `agent` runs in the soonest live session of its app; infinity when no plan says."""
        return self.sessions.steps(agent.app_id, agent.agent_id)

    def priority(self, block_hash: bytes) -> float | None:
        """The smallest steps-to-execution among agents whose fixed prefix holds the block."""
        if self._priorities is None:
            self._priorities = self._propagate()
        return self._priorities.get(block_hash)

    def agents(self) -> dict[AgentKey, tuple[float, int]]:
        """Every agent seen with a fixed prefix: its steps-to-execution and prefix blocks."""
        return {agent: (self.steps(agent), len(prefix)) for agent, prefix in self._prefixes.items()}

    def upcoming(self, load_ahead: int) -> list[UpcomingAgent]:
        """Agents with a known prefix due within `load_ahead` steps in some live session, soonest first."""
        self.expire()
        due = [UpcomingAgent(int(steps), agent, prefix) for agent, prefix in self._prefixes.items()
               if (steps := self.steps(agent)) <= load_ahead]
        return sorted(due)

    def _forget_apps(self, apps: set[str]) -> None:
        if apps:
            self._prefixes = {agent: p for agent, p in self._prefixes.items() if agent.app_id not in apps}

    def _propagate(self) -> dict[bytes, float]:
        """Each block takes the minimum over the agents using it; a prefix's earlier blocks
        are its ancestors in the cache tree, so this is KVFlow's upward propagation."""
        priorities: dict[bytes, float] = {}
        for agent, prefix in self._prefixes.items():
            steps = self.steps(agent)
            for block_hash in prefix:
                priorities[block_hash] = min(steps, priorities.get(block_hash, math.inf))
        return priorities
