"""WorkflowSessions: steps-to-execution per workflow instance (KVFlow, per session).

One app (one step graph) runs many workflow instances at once, each at its own place in
the graph: the gateway's plan for a request gives the steps-to-execution from that
session's requesting agent. With one map per app the last plan wins, and every other
session's next agent is ranked by where the last writer stands (3 out-of-phase sessions
of a 6-agent ring: the next agent was within load_ahead in about half the checks). So
each (app, session) keeps its own map, and an agent's steps are the minimum over its
app's live sessions: its prefix is needed as soon as the soonest session needs it.

A session whose request just finished moves that agent behind every other agent of the
session (KVFlow: the agent that just ran is the least likely to run next) until its next
plan says otherwise. A session silent for `idle_s` seconds is forgotten, so a finished
workflow stops holding prefixes; past `max_sessions` the least recently seen session is
dropped, so memory stays bounded however many sessions pass through.

The minimum is kept incrementally (per app and agent, how many sessions give each steps
value), so a plan costs O(agents in it) and a query O(distinct steps values), not a scan
of every session.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import NamedTuple

DEFAULT_SESSION = ""  # requests that name no session share one instance per app


class SessionKey(NamedTuple):
    app_id: str
    session_id: str


class WorkflowSessions:
    def __init__(self, idle_s: float = 600.0, max_sessions: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._last_seen: OrderedDict[SessionKey, float] = OrderedDict()  # least recently seen first
        self._steps: dict[SessionKey, dict[str, int]] = {}  # only sessions that have had a plan
        self._counts: dict[str, dict[str, Counter[int]]] = {}  # app -> agent -> steps value -> sessions
        self._num_sessions: Counter[str] = Counter()  # app -> live sessions

    def __len__(self) -> int:
        return len(self._last_seen)

    def observe(self, session: SessionKey, steps: Mapping[str, int] | None) -> set[str]:
        """A request of `session` arrived with its plan's steps-to-execution (None: no step
        graph, the session's known map stays). Returns the apps left with no live session
        (the oldest sessions dropped to stay within `max_sessions`)."""
        if session in self._last_seen:
            self._last_seen.move_to_end(session)
        else:
            self._num_sessions[session.app_id] += 1
        self._last_seen[session] = self._clock()
        if steps is not None:
            self._replace(session, dict(steps))
        gone: set[str] = set()
        while len(self._last_seen) > self.max_sessions:
            oldest = next(iter(self._last_seen))
            gone |= self._drop(oldest)
        return gone

    def finished(self, session: SessionKey, agent_id: str) -> bool:
        """`agent_id`'s request in `session` finished: it goes behind every other agent of
        the session. False when the session has no plan (nothing to reorder)."""
        steps = self._steps.get(session)
        if steps is None:
            return False
        others = [s for a, s in steps.items() if a != agent_id]
        self._replace(session, {**steps, agent_id: max(others, default=0) + 1})
        return True

    def expire(self) -> set[str]:
        """Forget the sessions silent for `idle_s` seconds; returns the apps left with none."""
        cutoff = self._clock() - self.idle_s
        gone: set[str] = set()
        while self._last_seen:
            oldest, seen = next(iter(self._last_seen.items()))
            if seen >= cutoff:
                break
            gone |= self._drop(oldest)
        return gone

    def steps(self, app_id: str, agent_id: str) -> float:
        """Steps until the agent runs in the soonest of its app's live sessions; infinity
        when no live session's plan names it."""
        counts = self._counts.get(app_id, {}).get(agent_id)
        return min(counts) if counts else math.inf

    def has_app(self, app_id: str) -> bool:
        return self._num_sessions[app_id] > 0

    def _replace(self, session: SessionKey, steps: dict[str, int]) -> None:
        """Make `steps` the session's map, moving its contribution to the per-agent counts."""
        self._uncount(session)
        self._steps[session] = steps
        if not steps:
            return
        agents = self._counts.setdefault(session.app_id, {})
        for agent_id, value in steps.items():
            agents.setdefault(agent_id, Counter())[value] += 1

    def _uncount(self, session: SessionKey) -> None:
        old = self._steps.pop(session, None)
        if not old:  # no plan, or one naming no agent: nothing counted
            return
        agents = self._counts[session.app_id]
        for agent_id, value in old.items():
            counts = agents[agent_id]
            counts[value] -= 1
            if counts[value] == 0:
                del counts[value]
                if not counts:
                    del agents[agent_id]
        if not agents:
            del self._counts[session.app_id]

    def _drop(self, session: SessionKey) -> set[str]:
        """Forget one session; returns its app when that was the app's last live session."""
        del self._last_seen[session]
        self._uncount(session)
        self._num_sessions[session.app_id] -= 1
        if self._num_sessions[session.app_id] > 0:
            return set()
        del self._num_sessions[session.app_id]
        return {session.app_id}
