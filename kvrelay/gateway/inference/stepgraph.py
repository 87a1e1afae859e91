"""StepGraph: which agent runs after which, learned per app from the traffic (KVFlow).

Nodes are agents. A dataflow edge A -> B means B's prompt quoted A's output; a
succession edge A -> B means B's request came right after A's in a session. An agent's
predecessors are its dataflow sources, or its succession sources when it has none.

Aggregation: an agent with several predecessors either waits for all of them (AND: it
runs one step after the last, max + 1) or for any one (OR: min + 1). It is learned from
the triggers observed: each time the agent runs, which predecessors produced fresh
output since its previous run. Always all of them means AND; once fewer, OR.

Steps-to-execution from the current position (the requesting agent is at step 0) are
computed in one pass in step order, as Dijkstra's algorithm does with unit steps
(Knuth's generalisation to max and min): an OR agent gets its step when its first
predecessor is reached, an AND agent when the last one it waits for is (a counter per
AND agent). An AND agent waits only for the predecessors that can still run before it:
those reachable from the current agent without passing through it, that is, those it
does not dominate (dominators.py); so in a loop, like a reviewer feeding the planner
again, it does not wait for itself. When nobody can go on (AND agents of a loop waiting
on each other), the one that usually follows the current agent goes first, after its
predecessors that have been reached.

Cost: O(E log V) for the dominator tree, kept per current agent until the graph's edges
change, and O((V + E) log V) for the pass, which stops after `limit` agents (a plan names
only the nearest) or at the request's deadline. The graph itself is bounded: its nodes
are the app's agents in memory (an evicted agent's node leaves with its edges) and a node
keeps at most `max_sources` sources of each kind (further ones are counted, not kept).

A step once given stands. The fixed-point relaxation this replaced lowered it again when
an agent that went first out of a waiting loop offered a shorter way to an agent reached
before; here that agent keeps the step it was reached with. Without such a loop both give
the same steps.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvrelay.wire.plan import WorkflowInfo
from kvrelay.gateway.inference.budget import NO_DEADLINE, Deadline, OutOfTime
from kvrelay.gateway.inference.dominators import Dominators

Aggregation = Literal["and", "or"]
EdgeKind = Literal["dataflow", "succession"]
_KEPT_DOMINATOR_TREES = 16  # current agents whose dominator tree is kept (per app)
_DEADLINE_EVERY = 64  # agents reached between two looks at the clock


@dataclass
class StepNode:
    dataflow: Counter[str] = field(default_factory=Counter)  # source agent -> times its output was read
    succession: Counter[str] = field(default_factory=Counter)  # agent that ran just before -> times
    waited_all: int = 0  # runs triggered by fresh output of every predecessor
    waited_some: int = 0  # runs triggered by fresh output of only some


class StepGraph:
    def __init__(self, max_sources: int = 64, bounded: Counter[str] | None = None) -> None:
        self.nodes: dict[str, StepNode] = {}
        self.max_sources = max_sources
        self.bounded: Counter[str] = bounded if bounded is not None else Counter()
        # Kept in step with `nodes` by every change, so no query rebuilds them:
        self._edges = _Adjacency()  # predecessors: dataflow sources, else succession sources
        self._order = _Adjacency()  # what the steps walk: sources it reads and ran right after (see _refresh)
        self._named_by: dict[str, set[str]] = {}  # agent -> the nodes whose counters name it
        self._version = 0  # bumped whenever a predecessor set changes
        self._dominators: OrderedDict[str, tuple[int, Dominators[str]]] = OrderedDict()

    # -- learning -------------------------------------------------------------------------------
    def observe(self, agent: str, read_from: set[str], fresh_from: set[str], previous: str | None) -> None:
        """Agent `agent` runs; it read outputs of `read_from`, of which `fresh_from` are new
        since its previous run; `previous` ran just before it in the session."""
        node = self._node(agent)
        for source in sorted(read_from - {agent}):
            self._count(agent, node.dataflow, source, 1)
        if previous is not None and previous != agent:
            self._count(agent, node.succession, previous, 1)
        self._refresh(agent)
        predecessors = self._edges.preds[agent]
        fresh = fresh_from & predecessors
        if len(predecessors) >= 2 and fresh:
            if fresh == predecessors:
                node.waited_all += 1
            else:
                node.waited_some += 1

    def restore_edge(self, target: str, source: str, kind: EdgeKind, count: int) -> None:
        """An edge saved in SQL (rows.py)."""
        node = self._node(target)
        self._count(target, node.dataflow if kind == "dataflow" else node.succession, source, count, replace=True)
        self._refresh(target)

    def restore_waits(self, agent: str, waited_all: int, waited_some: int) -> None:
        node = self._node(agent)
        node.waited_all, node.waited_some = waited_all, waited_some

    def remove(self, agent: str) -> None:
        """Forget an agent (evicted from memory): its node and every edge naming it."""
        node = self.nodes.pop(agent, None)
        if node is None:
            return
        for source in (*node.dataflow, *node.succession):
            self._named_by.get(source, set()).discard(agent)
        for target in self._named_by.pop(agent, set()):
            other = self.nodes[target]
            other.dataflow.pop(agent, None)
            other.succession.pop(agent, None)
            self._refresh(target)
        self._edges.remove(agent)
        self._order.remove(agent)
        self._version += 1
        self._dominators.pop(agent, None)

    # -- reading ----------------------------------------------------------------------------------
    def predecessors(self, agent: str) -> frozenset[str]:
        """Its dataflow sources, else the agents it ran right after (the graph's edges)."""
        return self._edges.preds.get(agent, frozenset())

    def step_predecessors(self, agent: str) -> frozenset[str]:
        """What the steps walk (see _refresh): its sources it has also run right after,
        else the agents it ran right after, else its sources."""
        return self._order.preds.get(agent, frozenset())

    def aggregation(self, agent: str) -> Aggregation:
        node = self.nodes.get(agent)
        return "and" if node is not None and node.waited_all > 0 and node.waited_some == 0 else "or"

    def edges(self) -> list[tuple[str, str, str]]:
        """(source, target, "dataflow" | "succession"), sorted."""
        out = [(src, dst, "dataflow") for dst, n in self.nodes.items() for src in n.dataflow if src != dst]
        out += [(src, dst, "succession") for dst, n in self.nodes.items() for src in n.succession
                if src != dst and src not in n.dataflow]
        return sorted(out)

    def steps_to_execution(self, current: str, limit: int | None = None,
                           deadline: Deadline = NO_DEADLINE) -> dict[str, int]:
        """Steps until each reachable agent runs, with `current` running now (step 0): all
        of them, or the first `limit` reached (nearest first), or those reached before
        the deadline."""
        steps: dict[str, int] = {}
        if current not in self.nodes:
            return {current: 0}
        dominators: Dominators[str] | None = None  # built when the first AND agent is reached
        queue: list[tuple[int, str]] = [(0, current)]  # (step, agent): reached, not yet settled
        offered: dict[str, int] = {}  # OR agent -> the step queued for it
        waiting: dict[str, int] = {}  # AND agent -> predecessors it still waits for
        last_wait: dict[str, int] = {}  # AND agent -> the latest step among those it waited for
        stuck: list[tuple[int, int, str]] = []  # AND agents to go first out of a loop, best first (lazy)
        while True:
            while queue:
                step, agent = heapq.heappop(queue)
                if agent in steps:
                    continue
                steps[agent] = step
                if len(steps) == limit or (len(steps) % _DEADLINE_EVERY == 0 and deadline.expired()):
                    return steps
                for target in self._order.succ.get(agent, ()):
                    if target in steps:
                        continue
                    if self.aggregation(target) == "or":
                        if step + 1 < offered.get(target, step + 2):
                            offered[target] = step + 1
                            heapq.heappush(queue, (step + 1, target))
                        continue
                    if target not in waiting:
                        try:
                            dominators = dominators or self._dominators_from(current, deadline)
                        except OutOfTime:
                            return steps
                        waiting[target] = sum(1 for p in self._order.preds[target]
                                              if dominators.reachable(p) and not dominators.dominates(target, p))
                    # A predecessor reached is always one it waits for: it was reached without passing through it.
                    waiting[target] -= 1
                    last_wait[target] = max(last_wait.get(target, 0), step)
                    if waiting[target] == 0:
                        heapq.heappush(queue, (last_wait[target] + 1, target))
                    else:
                        order = -self.nodes[target].succession[current]
                        heapq.heappush(stuck, (last_wait[target], order, target))
            if not self._go_first(stuck, steps, last_wait, queue):
                return steps

    def workflow(self, current: str, limit: int | None = None, deadline: Deadline = NO_DEADLINE) -> WorkflowInfo:
        """Steps from `current`, and the agents at step 1; when none is (no agent's step
        predecessors hold `current`: agents that run together, as a round's do, follow
        each other in any order), the agent that most often ran right after it."""
        steps = self.steps_to_execution(current, limit, deadline)
        following = sorted(a for a, s in steps.items() if s == 1)
        if not following:
            after = [(self.nodes[a].succession[current], a) for a in self._named_by.get(current, ())
                     if self.nodes[a].succession[current]]
            following = [max(after)[1]] if after else []
        return WorkflowInfo(steps_to_execution=steps, next=following)  # validated: faster than model_construct

    def mermaid(self, agents: set[str] | None = None, names: Mapping[str, str] | None = None) -> str:
        """The graph (or its part among `agents`) as Mermaid flowchart text: AND nodes as
        rhombi, dataflow edges solid, succession edges dotted; a node is labelled with
        its name in `names`, else its id."""
        keep = sorted(set(self.nodes) if agents is None else agents & set(self.nodes))
        ids = {agent: f"n{i}" for i, agent in enumerate(keep)}  # agent ids are free text: never used as ids
        lines = ["flowchart LR"]
        for agent in keep:
            label = '"' + (names or {}).get(agent, agent).replace('"', "#quot;") + '"'
            lines.append(f"    {ids[agent]}{{{label}}}" if self.aggregation(agent) == "and" else f"    {ids[agent]}[{label}]")
        for src, dst, kind in self.edges():
            if src in ids and dst in ids:
                lines.append(f"    {ids[src]} {'-->' if kind == 'dataflow' else '-.->'} {ids[dst]}")
        return "\n".join(lines)

    # -- inside -----------------------------------------------------------------------------------
    def _node(self, agent: str) -> StepNode:
        node = self.nodes.get(agent)
        if node is None:
            node = self.nodes[agent] = StepNode()
            self._edges.preds[agent] = self._order.preds[agent] = frozenset()
        return node

    def _count(self, target: str, counter: Counter[str], source: str, count: int, replace: bool = False) -> None:
        """Count an edge source -> target, unless it is new and the counter is full."""
        if source == target:
            return
        if source not in counter:
            if len(counter) >= self.max_sources:
                self.bounded["step_edges_not_kept"] += 1
                return
            self._node(source)
            self._named_by.setdefault(source, set()).add(target)
        counter[source] = count if replace else counter[source] + count

    def _refresh(self, agent: str) -> None:
        """Recompute an agent's predecessors after its counters changed: its dataflow
        sources (else those it ran after), and, for the steps, the sources it both reads
        and has run right after (else those it ran after, else those it reads). In a
        transcript every agent reads every other, so reading alone says nothing of the
        order: a round-robin's critic reads the planner and the writer but runs after
        the writer, and the planner runs after the critic."""
        node = self.nodes[agent]
        reads, after = frozenset(node.dataflow), frozenset(node.succession)
        changed = self._edges.update(agent, reads or after)
        changed |= self._order.update(agent, (reads & after) or after or reads)
        if changed:
            self._version += 1

    def _dominators_from(self, current: str, deadline: Deadline) -> Dominators[str]:
        kept = self._dominators.get(current)
        if kept is not None and kept[0] == self._version:
            self._dominators.move_to_end(current)
            return kept[1]
        tree = Dominators(current, self._order.succ, self._order.preds, deadline)
        self._dominators[current] = (self._version, tree)
        self._dominators.move_to_end(current)
        while len(self._dominators) > _KEPT_DOMINATOR_TREES:
            self._dominators.popitem(last=False)
        return tree

    @staticmethod
    def _go_first(stuck: list[tuple[int, int, str]], steps: dict[str, int], last_wait: dict[str, int],
                  queue: list[tuple[int, str]]) -> bool:
        """Nobody can go on: the waiting AND agent whose reached predecessors ran earliest
        goes first (ties: the one that most often followed the current agent, then by
        name), one step after them. False when nobody is waiting."""
        while stuck:
            after, _, agent = heapq.heappop(stuck)
            if agent not in steps and after == last_wait[agent]:  # else settled, or an outdated entry
                heapq.heappush(queue, (after + 1, agent))
                return True
        return False


class _Adjacency:
    """Predecessor sets and the successor sets they imply, kept in step."""

    def __init__(self) -> None:
        self.preds: dict[str, frozenset[str]] = {}  # agent -> its predecessors
        self.succ: dict[str, set[str]] = {}  # agent -> the agents it is a predecessor of

    def update(self, agent: str, now: frozenset[str]) -> bool:
        """Set an agent's predecessors; whether they changed."""
        before = self.preds.get(agent, frozenset())
        if now == before:
            return False
        for source in before - now:
            self.succ.get(source, set()).discard(agent)
        for source in now - before:
            self.succ.setdefault(source, set()).add(agent)
        self.preds[agent] = now
        return True

    def remove(self, agent: str) -> None:
        for source in self.preds.pop(agent, frozenset()):
            self.succ.get(source, set()).discard(agent)
        self.succ.pop(agent, None)
