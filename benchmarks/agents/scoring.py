"""The gateway's inferred structure against the capture's ground truth.

The truth is the capture's: which run (session) and agent sent each request, where each
prompt quotes an earlier answer, the task or a tool result, and which round of its app
a request belongs to (the app's own round tag, on requests that read earlier answers).
What the gateway inferred is, per request, its session, agent and the plan it sent:
read back from its SQL records by the bench (through the request id the gateway
returned with each answer), or taken from an in-process `Inference` by the offline
suite (tests/gateway/inference/test_capture_suite.py).

- placeholders: precision / recall / F1 over exact spans (request, message, start, end)
  of the right kind (an earlier answer, the question, a tool result); an answer's
  placeholder counts only when its source request is one that produced that text;
- sessions, agents: Rand index over all pairs of scored requests;
- rounds: a request is right when the requests sharing its predicted round are
  exactly those sharing its true one (none for a request outside any round);
- step-graph edges (when the caller has the graph): F1 of predecessor edges against the
  edges the capture shows (`true_edges`), each app's predicted agent ids read as the
  true agent of that app they most often stand for;
- next agent: for every request after which another agent ran next in its run (the
  requests that started first once it had ended), whether the plan's `workflow.next`
  named one of them (ids read the same way, within the request's app).

Predicted ids are read within each app because without an API key every app is the
gateway's one default app: two apps with byte-identical agents (the two village apps'
personas) get one id, which the agent Rand index counts as a merge, and which, in each
app, stands for that app's agent.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.agents.workload import Quote, Request, Run, Workload

Key = tuple[str, int]
AgentKey = tuple[str, str]  # (workload, agent): agents of two apps are never the same agent
Edge = tuple[AgentKey, AgentKey]  # (source, target)


@dataclass(frozen=True)
class Record:
    session_id: str | None
    agent_id: str | None
    plan: dict[str, Any] | None


@dataclass(frozen=True)
class Observed:
    """One request as the gateway handled it: its record, under the request id it was
    given, and the truth's quotes at their offsets in the prompt the gateway read."""

    request_id: str
    record: Record
    quotes: tuple[Quote, ...]


def read_records(db_path: Path) -> dict[str, Record]:
    """The gateway's request records by id (its SQLite file, read directly)."""
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT id, session_id, agent_id, plan FROM requests").fetchall()
    return {rid: Record(session, agent, json.loads(plan) if plan else None) for rid, session, agent, plan in rows}


@dataclass(frozen=True)
class InferenceScores:
    placeholder_precision: float
    placeholder_recall: float
    placeholder_f1: float
    session_rand: float
    agent_rand: float
    round_acc: float
    next_agent_acc: float
    next_agent_acc_warm: float  # where the agent had been seen followed by another before
    edge_f1: float | None  # None: the caller had no step graph to score
    scored: int  # requests with a record

    NAMES = ("placeholder_precision", "placeholder_recall", "placeholder_f1", "session_rand", "agent_rand",
             "round_acc", "next_agent_acc", "next_agent_acc_warm", "edge_f1")

    def metrics(self, suffix: str = "") -> dict[str, float]:
        return {f"{name}{suffix}": float(value) for name in self.NAMES
                if (value := getattr(self, name)) is not None}


def score(workloads: list[Workload], observed: Mapping[Key, Observed],
          predicted_edges: set[tuple[str, str]] | None = None) -> InferenceScores:
    """Score what the gateway inferred of `observed` requests; `predicted_edges` are the
    step graph's (source agent id, target agent id) pairs, when the caller has them."""
    requests = {r.key: r for w in workloads for r in w.requests}
    keys = sorted(observed)
    records = {k: observed[k].record for k in keys}
    by_request_id = {observed[k].request_id: k for k in keys}
    precision, recall, f1 = _placeholders(observed, by_request_id)
    true_agents = {k: (requests[k].workload, requests[k].agent) for k in keys}
    agents = majority(((k[0], records[k].agent_id), true_agents[k]) for k in keys)
    edge_f1 = None
    if predicted_edges is not None:
        mapped = {(agents[(w.name, s)], agents[(w.name, t)]) for w in workloads for s, t in predicted_edges
                  if (w.name, s) in agents and (w.name, t) in agents}
        edge_f1 = f1_score(true_edges(workloads), {(s, t) for s, t in mapped if s != t})
    return InferenceScores(
        precision, recall, f1,
        rand_index([(requests[k].workload, requests[k].run) for k in keys], [records[k].session_id for k in keys]),
        rand_index([true_agents[k] for k in keys], [records[k].agent_id for k in keys]),
        _rounds(keys, requests, records),
        _next_agent(workloads, records, agents),
        _next_agent(workloads, records, agents, warm_only=True),
        edge_f1,
        len(keys))


def observed_from(outcomes: Mapping[Key, Any], records: Mapping[str, Record]) -> dict[Key, Observed]:
    """The bench's view: every replayed request (a replay Outcome) the gateway recorded."""
    return {key: Observed(o.request_id, records[o.request_id], tuple(o.quotes)) for key, o in outcomes.items()
            if o.request_id is not None and o.request_id in records}


def rand_index(truth: list[Hashable], predicted: list[Hashable]) -> float:
    """Share of pairs on which the two partitions agree (same group in both, or in neither);
    counted from the contingency table, so it is quadratic in groups, not requests."""
    n = len(truth)
    if n < 2:
        return 1.0
    pairs = n * (n - 1) // 2
    both = sum(c * (c - 1) // 2 for c in Counter(zip(truth, predicted)).values())
    same_true = sum(c * (c - 1) // 2 for c in Counter(truth).values())
    same_pred = sum(c * (c - 1) // 2 for c in Counter(predicted).values())
    return (pairs - same_true - same_pred + 2 * both) / pairs


def majority(pairs: Iterable[tuple[Hashable, Hashable]]) -> dict[Any, Any]:
    """Each key's most frequent partner (ties: the smallest by repr, so order does not matter)."""
    counts: dict[Any, Counter[Any]] = defaultdict(Counter)
    for key, value in pairs:
        counts[key][value] += 1
    return {k: min(c, key=lambda v: (-c[v], repr(v))) for k, c in counts.items()}


def f1_score(true: set[Any], predicted: set[Any]) -> float:
    hits = len(true & predicted)
    precision = hits / len(predicted) if predicted else 1.0
    recall = hits / len(true) if true else 1.0
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def true_edges(workloads: list[Workload]) -> set[Edge]:
    """The step graph the capture shows, by the graph's own definition (stepgraph.py): B's
    predecessors are the agents whose answers B's prompts quote (every agent that gave
    the quoted text), or, for an agent that quotes no other agent, the agents whose
    request ended last before each of its requests began in its run."""
    edges: set[Edge] = set()
    for workload in workloads:
        by_seq = {r.seq: r for r in workload.requests}
        dataflow: dict[str, set[str]] = defaultdict(set)
        succession: dict[str, set[str]] = defaultdict(set)
        for run in workload.runs:
            for request in run.requests:
                for quote in request.quotes:
                    if quote.kind == "output":
                        dataflow[request.agent] |= {by_seq[s].agent for s in quote.sources} - {request.agent}
                before = [r for r in run.waits_for(request) if r.agent != request.agent]
                if before:
                    last = max(r.t_end for r in before)
                    succession[request.agent] |= {r.agent for r in before if r.t_end == last}
        for agent in dataflow.keys() | succession.keys():
            sources = dataflow[agent] or succession[agent]
            edges |= {((workload.name, s), (workload.name, agent)) for s in sources}
    return edges


_KINDS = {"user_question": "question", "agent": "output", "condition": "tool_result"}


def _kind(name: str | None) -> str | None:
    if not name:
        return None
    return _KINDS.get(name) or _KINDS.get(name.split("_", 1)[0])


def _placeholders(observed: Mapping[Key, Observed], by_request_id: Mapping[str, Key]) -> tuple[float, float, float]:
    truth: dict[tuple, tuple[str, set[int]]] = {}
    for key, seen in observed.items():
        for quote in seen.quotes:
            if quote.part is None and quote.end > quote.start:
                truth[(key, quote.message, quote.start, quote.end)] = (quote.kind, set(quote.sources))
    predicted = matched = 0
    for key, seen in observed.items():
        for segment in (seen.record.plan or {}).get("segments", []):
            if segment.get("kind") != "placeholder":
                continue
            predicted += 1
            span = (key, segment["message_index"], segment["char_start"], segment["char_end"])
            if span not in truth or truth[span][0] != _kind(segment.get("name")):
                continue
            true_kind, sources = truth[span]
            source = by_request_id.get(segment.get("source_request"))
            if true_kind != "output" or (source is not None and source[1] in sources):
                matched += 1
    precision = matched / predicted if predicted else 1.0
    recall = matched / len(truth) if truth else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def _rounds(keys: list[Key], requests: Mapping[Key, Request], records: Mapping[Key, Record]) -> float:
    def true_round(k: Key) -> tuple | None:
        r = requests[k]
        reads_answers = any(q.kind == "output" for q in r.quotes)
        return (r.workload, r.run, r.round) if r.round is not None and reads_answers else None

    def predicted_round(k: Key) -> str | None:
        return ((records[k].plan or {}).get("round") or {}).get("id")

    true, predicted = _groups(keys, true_round), _groups(keys, predicted_round)
    right = sum(true.get(k, frozenset()) - {k} == predicted.get(k, frozenset()) - {k} for k in keys)
    return right / len(keys) if keys else 1.0


def _groups(keys: list[Key], label_of: Callable[[Key], Hashable | None]) -> dict[Key, frozenset[Key]]:
    """Each labelled key's group: every key with the same label (an unlabelled key has none)."""
    by_label: dict[Hashable, set[Key]] = defaultdict(set)
    for k in keys:
        label = label_of(k)
        if label is not None:
            by_label[label].add(k)
    return {k: frozenset(group) for group in by_label.values() for k in group}


def next_agents(run: Run, request: Request) -> list[Request]:
    """The requests that ran next after `request` in its run: those that started first
    once it had ended (all of them when several started together, as a round's agents
    do). Empty at the end of the run."""
    after = [r for r in run.requests if r.t_start >= request.t_end and r.seq != request.seq]
    if not after:
        return []
    first_end = min(r.t_end for r in after if r.t_start == min(a.t_start for a in after))
    return [r for r in after if r.t_start < first_end]


def _next_agent(workloads: list[Workload], records: Mapping[Key, Record],
                agents: Mapping[tuple[str, Any], AgentKey], warm_only: bool = False) -> float:
    """`warm_only`: only requests whose agent the gateway had already seen followed by
    another agent (a successor of one of its earlier requests had started before this
    request did): where it could know what comes next."""
    changes = hits = 0
    for workload in workloads:
        followed_at: dict[str, float] = {}  # agent -> when a successor of it first started
        runs = {run.name: run for run in workload.runs}
        for request in sorted(workload.requests, key=lambda r: r.t_start):
            following = next_agents(runs[request.run], request)
            agents_next = {r.agent for r in following}
            if request.key not in records or not agents_next - {request.agent}:
                continue
            warm = followed_at.get(request.agent, request.t_start + 1) <= request.t_start
            first = min(r.t_start for r in following)
            followed_at[request.agent] = min(followed_at.get(request.agent, first), first)
            if warm_only and not warm:
                continue
            changes += 1
            workflow = (records[request.key].plan or {}).get("workflow") or {}
            named = {agents.get((workload.name, a)) for a in workflow.get("next", [])}
            hits += any((workload.name, agent) in named for agent in agents_next)
    return hits / changes if changes else 1.0
