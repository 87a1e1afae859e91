"""The real-capture suite: every app of tests/data/agents (AutoGen, LangGraph, the OpenAI
Agents SDK and plain openai-client teams) replayed through one Inference as the gateway
would see them (capture_replay.py), scored against the capture's own labels by the
agents bench's scorer. Run with -s to see the table per app."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from benchmarks.agents.scoring import InferenceScores, score
from benchmarks.agents.workload import Workload, load_all
from tests.gateway.inference.capture_replay import CaptureReplay, replay

TARGETS = {"placeholder_f1": 0.95, "session_rand": 0.98, "agent_rand": 0.98, "round_acc": 0.95, "edge_f1": 0.95,
           "next_agent_acc": 0.90, "next_agent_acc_warm": 0.90}
# Known shortfalls, kept visible (strict: the day they pass, the mark must go).
SHORTFALLS = {
    "next_agent_acc": "cold start: an agent's first requests come before the gateway has seen any agent follow it "
                      "(the first run of every app, each villager's first round); where it has, next_agent_acc_warm",
}


@functools.cache
def workloads() -> tuple[Workload, ...]:
    return tuple(load_all())


@functools.cache
def replayed() -> CaptureReplay:
    return replay(list(workloads()))


@functools.cache
def scores(app: str | None = None) -> InferenceScores:
    chosen = [w for w in workloads() if app is None or w.name == app]
    observed = {k: o for k, o in replayed().observed.items() if app is None or k[0] == app}
    return score(chosen, observed, replayed().edges)


def test_print_the_metrics_table():
    names = InferenceScores.NAMES
    lines = [f"{'app':<20}{'reqs':>5}" + "".join(f"{n.replace('placeholder_', 'ph_')[:11]:>12}" for n in names)]
    for app in [w.name for w in workloads()] + [None]:
        s = scores(app)
        lines.append(f"{app or 'ALL':<20}{s.scored:>5}" + "".join(f"{getattr(s, n):>12.3f}" for n in names))
    print("\n" + "\n".join(lines))
    assert scores().scored == sum(len(w.requests) for w in workloads())


@pytest.mark.parametrize("metric", [pytest.param(m, marks=[pytest.mark.xfail(strict=True, reason=SHORTFALLS[m])]
                                                 if m in SHORTFALLS else []) for m in TARGETS])
def test_inference_meets_its_target_on_real_traffic(metric: str):
    value = getattr(scores(), metric)
    assert value >= TARGETS[metric], f"{metric} = {value:.3f} < {TARGETS[metric]}"


# -- what the suite holds: the cases that broke inference must stay in it ---------------------


def test_the_suite_holds_the_hard_cases():
    runs = [run for w in workloads() for run in w.runs]
    tasks = Counter((run.workload, run.task) for run in runs)
    assert any(n >= 2 for n in tasks.values()), "repeat runs of one task"
    assert any(run.concurrent_group for run in runs), "runs at the same time"
    requests = [r for w in workloads() for r in w.requests]
    assert any(q.kind == "tool_result" and q.end - q.start < 16 for r in requests for q in r.quotes), "short tool results"
    agent_of = {r.key: r.agent for r in requests}
    assert any(q.kind == "output" and len({agent_of[(r.workload, s)] for s in q.sources}) >= 2
               for r in requests for q in r.quotes), "identical outputs of two agents"
    assert any(not any(m.get("role") == "system" for m in r.body.get("messages", [])) for r in requests), \
        "requests without a system prompt"
    systems: dict[str, set[str]] = {}
    for r in requests:
        for m in r.body.get("messages", []):
            if m.get("role") == "system" and isinstance(m.get("content"), str):
                systems.setdefault(m["content"], set()).add(r.workload)
    assert any(len(owners) >= 2 for owners in systems.values()), "two apps sharing an agent prompt"
    assert not any(r.headers.get(h) for r in requests for h in ("x-client-id", "x-kvrelay-app", "authorization")), \
        "every app lands in the one default app"

