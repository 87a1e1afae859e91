"""Scores for inferred multi-agent structure against the labels of a trace.

The gateway invents its own ids (random session ids, hashed agent ids, per-session round
ids), so ids are compared through a mapping learned from co-occurrence: each predicted id
stands for the true label it most often comes with. That alone would forgive merging
(one predicted id for two true sessions), so session, agent and round accuracy also run
the mapping the other way (each true label to the predicted id it most often gets) and
report the lower of the two. Placeholders and step-graph edges are compared as exact
sets, with predicted agent ids translated to true agent names first.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Hashable)

Span = tuple[int, int, int, str]  # (message_index, char_start, char_end, placeholder name)
Edge = tuple[str, str, str]  # (app, source agent, target agent)

METRICS = ("session", "agent", "placeholder_precision", "placeholder_recall", "round", "edge_f1", "next_agent",
           "next_agent_warm")
_PLACEHOLDER = re.compile(r"^(agent|condition)_(.+)_(current|history_\d+)$")


@dataclass(frozen=True)
class Observed:
    """One request: as its labels say it is, or as the gateway inferred it."""

    app: str
    session: str
    agent: str
    placeholders: frozenset[Span]
    round: str | None  # None: not part of a round
    next: frozenset[str] = frozenset()  # predicted only: the plan's `workflow.next`
    wave: int | None = None  # truth only: the step the generator sent it in (a session's requests of one run together)


@dataclass(frozen=True)
class Scores:
    requests: int
    session: float
    agent: float
    placeholder_precision: float
    placeholder_recall: float
    round: float
    round_forward: float  # predicted round -> majority true round only: blind to rounds invented or split
    spurious_rounds: int  # requests given a round although they belong to none
    edge_f1: float
    next_agent: float  # at each agent change in a session, whether the plan named the agent that came next
    next_agent_warm: float  # the same where the agent had been seen followed by another before


def majority(pairs: Iterable[tuple[K, V]]) -> dict[K, V]:
    """Each key's most frequent partner; ties go to the smallest partner by repr, so the
    result does not depend on the order the pairs come in."""
    counts: dict[K, Counter[V]] = {}
    for key, value in pairs:
        counts.setdefault(key, Counter())[value] += 1
    return {k: min(c, key=lambda v: (-c[v], repr(v))) for k, c in counts.items()}


def directed_accuracy(predicted: Sequence[K], true: Sequence[V]) -> float:
    """Share of items whose predicted id, mapped to its majority true label, is right."""
    if not true:
        return 1.0
    mapping = majority(zip(predicted, true))
    return sum(mapping[p] == t for p, t in zip(predicted, true)) / len(true)


def mapped_accuracy(predicted: Sequence[K], true: Sequence[V]) -> float:
    """The lower of both directions: splitting a true id and merging two both cost."""
    return min(directed_accuracy(predicted, true), directed_accuracy(true, predicted))


def agent_mapping(truth: Sequence[Observed], predicted: Sequence[Observed]) -> dict[tuple[str, str], str]:
    """(app, predicted agent id) -> the true agent name it most often stands for."""
    return majority(((p.app, p.agent), t.agent) for t, p in zip(truth, predicted))


def translate(name: str, app: str, mapping: Mapping[tuple[str, str], str]) -> str:
    """A predicted placeholder name with its agent id replaced by the true agent name."""
    match = _PLACEHOLDER.match(name)
    if match is None:
        return name
    stem, agent, suffix = match.groups()
    return f"{stem}_{mapping.get((app, agent), agent)}_{suffix}"


def f1(true: set[Hashable], predicted: set[Hashable]) -> float:
    precision, recall = precision_recall(true, predicted)
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def precision_recall(true: set[Hashable], predicted: set[Hashable]) -> tuple[float, float]:
    hits = len(true & predicted)
    return (hits / len(predicted) if predicted else 1.0, hits / len(true) if true else 1.0)


def score(truth: Sequence[Observed], predicted: Sequence[Observed], true_edges: set[Edge],
          predicted_edges: set[Edge]) -> Scores:
    if len(truth) != len(predicted):
        raise ValueError(f"{len(truth)} labelled requests but {len(predicted)} predictions")
    agents = agent_mapping(truth, predicted)
    true_spans = {(i, *s) for i, t in enumerate(truth) for s in t.placeholders}
    predicted_spans = {(i, m, a, b, translate(name, p.app, agents))
                       for i, p in enumerate(predicted) for m, a, b, name in p.placeholders}
    precision, recall = precision_recall(true_spans, predicted_spans)
    translated_edges = {(app, agents.get((app, src), src), agents.get((app, dst), dst))
                        for app, src, dst in predicted_edges}
    return Scores(
        requests=len(truth),
        session=mapped_accuracy([(p.app, p.session) for p in predicted], [(t.app, t.session) for t in truth]),
        agent=mapped_accuracy([(p.app, p.agent) for p in predicted], [(t.app, t.agent) for t in truth]),
        placeholder_precision=precision,
        placeholder_recall=recall,
        round=mapped_accuracy([_round_key(p) for p in predicted], [_round_key(t) for t in truth]),
        round_forward=_round_forward([_round_key(p) for p in predicted], [_round_key(t) for t in truth]),
        spurious_rounds=sum(t.round is None and p.round is not None for t, p in zip(truth, predicted)),
        edge_f1=f1(set(true_edges), translated_edges),
        next_agent=next_agent_accuracy(truth, predicted, agents),
        next_agent_warm=next_agent_accuracy(truth, predicted, agents, warm_only=True),
    )


def next_agent_accuracy(truth: Sequence[Observed], predicted: Sequence[Observed],
                        agents: Mapping[tuple[str, str], str], warm_only: bool = False) -> float:
    """For every request after which another agent ran next in its session (the agents
    of the session's next wave: a round's agents run together), the share whose plan
    named one of them in `workflow.next` (ids read through `agents`). `warm_only`: only
    requests whose agent the gateway had already seen followed by another (before this
    request, an earlier request of that agent had a successor): where it could know."""
    waves: dict[tuple[str, str], dict[int, list[int]]] = {}  # (app, session) -> wave -> its requests
    for n, t in enumerate(truth):
        waves.setdefault((t.app, t.session), {}).setdefault(n if t.wave is None else t.wave, []).append(n)
    followed_at: dict[tuple[str, str], int] = {}  # (app, agent) -> when the gateway first saw its successor
    changes = hits = 0
    for n, (t, p) in enumerate(zip(truth, predicted)):
        session = waves[(t.app, t.session)]
        wave = n if t.wave is None else t.wave
        later = [w for w in session if w > wave]
        following = session[min(later)] if later else []
        agents_next = {truth[m].agent for m in following}
        if not agents_next - {t.agent}:
            continue
        key = (t.app, t.agent)
        warm = followed_at.get(key, n) < n
        followed_at[key] = min(followed_at.get(key, following[0]), following[0])
        if warm_only and not warm:
            continue
        changes += 1
        hits += bool(agents_next & {agents.get((p.app, a), a) for a in p.next})
    return hits / changes if changes else 1.0


def _round_forward(predicted: Sequence[Hashable], true: Sequence[Hashable]) -> float:
    """Predicted round -> its majority true round; no round is right only against no round.
    Kept for reference: a round invented for one request maps to "no round" and counts
    as right, which is why `round` also maps the other way."""
    if not true:
        return 1.0
    mapping = majority((p, t) for p, t in zip(predicted, true) if p is not None)
    return sum((t is None) if p is None else mapping[p] == t for p, t in zip(predicted, true)) / len(true)


def _round_key(observed: Observed) -> tuple[str, str] | None:
    return None if observed.round is None else (observed.app, observed.round)


def table(rows: Mapping[str, Scores]) -> str:
    """A compact fixed-width table, one trace per line."""
    head = (f"{'trace':<28}{'reqs':>5}{'sess':>7}{'agent':>7}{'ph_P':>7}{'ph_R':>7}{'round':>7}{'r_fwd':>7}"
            f"{'spur':>6}{'edgeF1':>8}{'next':>7}{'n_warm':>7}")
    lines = [head, "-" * len(head)]
    for name, s in rows.items():
        lines.append(f"{name:<28}{s.requests:>5}{s.session:>7.3f}{s.agent:>7.3f}{s.placeholder_precision:>7.3f}"
                     f"{s.placeholder_recall:>7.3f}{s.round:>7.3f}{s.round_forward:>7.3f}{s.spurious_rounds:>6}"
                     f"{s.edge_f1:>8.3f}{s.next_agent:>7.3f}{s.next_agent_warm:>7.3f}")
    return "\n".join(lines)
