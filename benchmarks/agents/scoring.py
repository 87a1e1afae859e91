"""The gateway's inferred structure against the capture's ground truth.

The truth is the capture's: which run (session) and agent sent each request, where each
prompt quotes an earlier answer, the task or a tool result, and which round of its app
a request belongs to (the app's own round tag, on requests that read earlier answers).
What the gateway inferred is read back from its SQL records (session, agent and the
plan it sent), found through the request id the gateway returned with each answer.

- placeholders: precision / recall / F1 over exact spans (request, message, start, end)
  of the right kind (an earlier answer, the question, a tool result); an answer's
  placeholder counts only when its source request is one that produced that text;
- sessions, agents: Rand index over all pairs of scored requests;
- rounds: a request is right when the requests sharing its predicted round are
  exactly those sharing its true one (none for a request outside any round);
- next agent: at every agent change inside a run, whether the plan's `workflow.next`
  named the agent that really came next (predicted ids read through the majority
  mapping of predicted to true agents).
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.agents.replay import Key, Outcome
from benchmarks.agents.workload import Request, Workload


@dataclass(frozen=True)
class Record:
    session_id: str | None
    agent_id: str | None
    plan: dict[str, Any] | None


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
    scored: int  # requests with a record

    def metrics(self, suffix: str = "") -> dict[str, float]:
        return {f"{name}{suffix}": float(getattr(self, name)) for name in (
            "placeholder_precision", "placeholder_recall", "placeholder_f1", "session_rand", "agent_rand",
            "round_acc", "next_agent_acc")}


def score(workloads: list[Workload], outcomes: Mapping[Key, Outcome], records: Mapping[str, Record]) -> InferenceScores:
    requests = {r.key: r for w in workloads for r in w.requests}
    scored = {key: records[o.request_id] for key, o in outcomes.items()
              if o.request_id is not None and o.request_id in records}
    by_record = {outcomes[key].request_id: key for key in scored}
    precision, recall, f1 = _placeholders(scored, outcomes, by_record)
    keys = sorted(scored)
    true_agents = {k: (requests[k].workload, requests[k].agent) for k in keys}
    return InferenceScores(
        precision, recall, f1,
        rand_index([(requests[k].workload, requests[k].run) for k in keys], [scored[k].session_id for k in keys]),
        rand_index([true_agents[k] for k in keys], [scored[k].agent_id for k in keys]),
        _rounds(keys, requests, scored),
        _next_agent(workloads, scored, true_agents),
        len(scored))


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


_KINDS = {"user_question": "question", "agent": "output", "condition": "tool_result"}


def _kind(name: str | None) -> str | None:
    if not name:
        return None
    return _KINDS.get(name) or _KINDS.get(name.split("_", 1)[0])


def _placeholders(scored: Mapping[Key, Record], outcomes: Mapping[Key, Outcome],
                  by_record: Mapping[str | None, Key]) -> tuple[float, float, float]:
    truth: dict[tuple, tuple[str, set[int]]] = {}
    for key in scored:
        for quote in outcomes[key].quotes:
            if quote.part is None and quote.end > quote.start:
                truth[(key, quote.message, quote.start, quote.end)] = (quote.kind, set(quote.sources))
    predicted = matched = 0
    for key, record in scored.items():
        for segment in (record.plan or {}).get("segments", []):
            if segment.get("kind") != "placeholder":
                continue
            predicted += 1
            span = (key, segment["message_index"], segment["char_start"], segment["char_end"])
            kind = _kind(segment.get("name"))
            if span not in truth or truth[span][0] != kind:
                continue
            true_kind, sources = truth[span]
            source = by_record.get(segment.get("source_request"))
            if true_kind != "output" or (source is not None and source[1] in sources):
                matched += 1
    precision = matched / predicted if predicted else 1.0
    recall = matched / len(truth) if truth else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def _rounds(keys: list[Key], requests: Mapping[Key, Request], scored: Mapping[Key, Record]) -> float:
    def true_round(k: Key) -> tuple | None:
        r = requests[k]
        reads_answers = any(q.kind == "output" for q in r.quotes)
        return (r.workload, r.run, r.round) if r.round is not None and reads_answers else None

    def predicted_round(k: Key) -> str | None:
        return ((scored[k].plan or {}).get("round") or {}).get("id")

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


def _next_agent(workloads: list[Workload], scored: Mapping[Key, Record],
                true_agents: Mapping[Key, tuple[str, str]]) -> float:
    votes: dict[str | None, Counter[tuple[str, str]]] = defaultdict(Counter)
    for key, record in scored.items():
        votes[record.agent_id][true_agents[key]] += 1
    mapping = {pred: counter.most_common(1)[0][0] for pred, counter in votes.items()}
    changes = hits = 0
    for run in (run for w in workloads for run in w.runs):
        for this, following in itertools.pairwise(run.requests):
            if this.agent == following.agent or this.key not in scored:
                continue
            changes += 1
            workflow = (scored[this.key].plan or {}).get("workflow") or {}
            named = {mapping.get(agent) for agent in workflow.get("next", [])}
            hits += (following.workload, following.agent) in named
    return hits / changes if changes else 1.0
