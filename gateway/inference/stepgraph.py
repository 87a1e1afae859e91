"""StepGraph: which agent runs after which, learned per app from the traffic (KVFlow).

Nodes are agents. A dataflow edge A -> B means B's prompt quoted A's output; a
succession edge A -> B means B's request came right after A's in a session. An agent's
predecessors are its dataflow sources, or its succession sources when it has none.

Aggregation: an agent with several predecessors either waits for all of them (AND: it
runs one step after the last, max + 1) or for any one (OR: min + 1). It is learned from
the triggers observed: each time the agent runs, which predecessors produced fresh
output since its previous run. Always all of them means AND; once fewer, OR.

Steps-to-execution from the current position (the requesting agent is at step 0) are
the fixed point of that recurrence, computed by relaxation (at most one round per
agent, so cycles, like a reviewer feeding the planner again, terminate).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from engine_ext.protocol import WorkflowInfo

Aggregation = Literal["and", "or"]


@dataclass
class StepNode:
    dataflow: Counter[str] = field(default_factory=Counter)  # source agent -> times its output was read
    succession: Counter[str] = field(default_factory=Counter)  # agent that ran just before -> times
    waited_all: int = 0  # runs triggered by fresh output of every predecessor
    waited_some: int = 0  # runs triggered by fresh output of only some


class StepGraph:
    def __init__(self) -> None:
        self.nodes: dict[str, StepNode] = {}

    def observe(self, agent: str, read_from: set[str], fresh_from: set[str], previous: str | None) -> None:
        """Agent `agent` runs; it read outputs of `read_from`, of which `fresh_from` are new
        since its previous run; `previous` ran just before it in the session."""
        node = self.nodes.setdefault(agent, StepNode())
        for source in read_from - {agent}:
            self.nodes.setdefault(source, StepNode())
            node.dataflow[source] += 1
        if previous is not None and previous != agent:
            self.nodes.setdefault(previous, StepNode())
            node.succession[previous] += 1
        predecessors = self.predecessors(agent)
        fresh = fresh_from & predecessors
        if len(predecessors) >= 2 and fresh:
            if fresh == predecessors:
                node.waited_all += 1
            else:
                node.waited_some += 1

    def predecessors(self, agent: str) -> set[str]:
        node = self.nodes.get(agent)
        if node is None:
            return set()
        return set(node.dataflow) - {agent} or set(node.succession) - {agent}

    def aggregation(self, agent: str) -> Aggregation:
        node = self.nodes.get(agent)
        return "and" if node is not None and node.waited_all > 0 and node.waited_some == 0 else "or"

    def edges(self) -> list[tuple[str, str, str]]:
        """(source, target, "dataflow" | "succession"), sorted."""
        out = [(src, dst, "dataflow") for dst, n in self.nodes.items() for src in n.dataflow if src != dst]
        out += [(src, dst, "succession") for dst, n in self.nodes.items() for src in n.succession
                if src != dst and src not in n.dataflow]
        return sorted(out)

    def steps_to_execution(self, current: str) -> dict[str, int]:
        """Steps until each reachable agent runs, with `current` running now (step 0).

        An AND agent waits only for the predecessors that can still run before it: those
        reachable from `current` without passing through the agent itself (in a loop, the
        others have already produced their output this time around)."""
        preds = {agent: self.predecessors(agent) for agent in self.nodes}
        successors: dict[str, set[str]] = {agent: set() for agent in self.nodes}
        for agent, sources in preds.items():
            for source in sources:
                successors.setdefault(source, set()).add(agent)
        steps: dict[str, int] = {current: 0}
        for _ in range(2 * len(self.nodes) + 1):
            changed = False
            for agent in self.nodes:
                if agent == current or not preds[agent]:
                    continue
                if self.aggregation(agent) == "and":
                    ahead = _reachable(successors, current, avoid=agent) | {current}
                    waits_for = preds[agent] & ahead
                    if not waits_for or not waits_for <= steps.keys():
                        continue
                    value = max(steps[p] for p in waits_for) + 1
                else:
                    known = [steps[p] for p in preds[agent] if p in steps]
                    if not known:
                        continue
                    value = min(known) + 1
                if agent not in steps or value < steps[agent]:
                    steps[agent], changed = value, True
            if not changed and not self._break_wait(steps, preds, current):
                break
        return steps

    def _break_wait(self, steps: dict[str, int], preds: dict[str, set[str]], current: str) -> bool:
        """AND agents can wait on each other in a loop where every agent reads every other
        (a full transcript). Let the one that usually follows `current` go first, after
        the predecessors that are known; False when nobody is waiting."""
        waiting = [a for a in self.nodes if a not in steps and preds[a] & steps.keys()]
        if not waiting:
            return False
        agent = min(waiting, key=lambda a: (max(steps[p] for p in preds[a] & steps.keys()),
                                            -self.nodes[a].succession[current], a))
        steps[agent] = max(steps[p] for p in preds[agent] & steps.keys()) + 1
        return True

    def workflow(self, current: str) -> WorkflowInfo:
        steps = self.steps_to_execution(current)
        return WorkflowInfo(steps_to_execution=steps, next=sorted(a for a, s in steps.items() if s == 1))

    def mermaid(self, agents: set[str] | None = None) -> str:
        """The graph (or its part among `agents`) as Mermaid flowchart text: AND nodes as
        rhombi, dataflow edges solid, succession edges dotted."""
        keep = sorted(set(self.nodes) if agents is None else agents & set(self.nodes))
        ids = {agent: f"n{i}" for i, agent in enumerate(keep)}  # agent ids are free text: never used as ids
        lines = ["flowchart LR"]
        for agent in keep:
            label = '"' + agent.replace('"', "#quot;") + '"'
            lines.append(f"    {ids[agent]}{{{label}}}" if self.aggregation(agent) == "and" else f"    {ids[agent]}[{label}]")
        for src, dst, kind in self.edges():
            if src in ids and dst in ids:
                lines.append(f"    {ids[src]} {'-->' if kind == 'dataflow' else '-.->'} {ids[dst]}")
        return "\n".join(lines)


def _reachable(successors: dict[str, set[str]], start: str, avoid: str) -> set[str]:
    seen, frontier = {start}, [start]
    while frontier:
        for nxt in successors.get(frontier.pop(), ()):
            if nxt != avoid and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return seen - {start}
