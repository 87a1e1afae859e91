"""The labelled trace suite: replay each trace of tests/data/traces through a fresh
Inference, exactly as the gateway would call it, and score what it inferred (sessions,
agents, placeholders, rounds, step-graph edges) against labels the generator wrote from
how it built each prompt. Run with -s to see the table of every metric per trace."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.settings import InferenceSettings
from tests.gateway.inference.trace_metrics import (
    METRICS,
    Edge,
    Observed,
    Scores,
    mapped_accuracy,
    score,
    table,
)

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
TRACE_NAMES = sorted(p.stem for p in TRACES.glob("*.jsonl"))
THRESHOLD = 0.98


def load(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, request records) of one trace file."""
    lines = [json.loads(line) for line in (TRACES / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    header = lines[0] if "trace" in lines[0] else {"trace": name, "edges": {}}
    return header, [line for line in lines if "trace" not in line]


def truth_of(records: list[dict[str, Any]]) -> list[Observed]:
    return [Observed(r["labels"]["app"], r["labels"]["session"], r["labels"]["agent"],
                     frozenset(tuple(p) for p in r["labels"]["placeholders"]), r["labels"]["round"],
                     wave=r["labels"]["wave"]) for r in records]


def true_edges_of(header: dict[str, Any]) -> set[Edge]:
    return {(app, src, dst) for app, edges in header["edges"].items() for src, dst in edges}


def replay(records: list[dict[str, Any]]) -> tuple[list[Observed], set[Edge]]:
    """Plan every request in file order, then let the inference see its answer."""
    inference = Inference(InferenceSettings())
    predicted = []
    for n, record in enumerate(records):
        request_id = f"req-{n}"
        ident = identify(record["headers"], record["body"], None)
        result = inference.plan(ident, record["body"], request_id, record["model"])
        inference.observe_response(ident.app_id, result.session_id, result.agent_id, request_id, record["response"])
        spans = frozenset((s.message_index, s.char_start, s.char_end, s.name or "")
                          for s in result.plan.segments if s.kind == "placeholder")
        round_id = result.plan.round.id if result.plan.round is not None else None
        following = frozenset(result.plan.workflow.next) if result.plan.workflow is not None else frozenset()
        predicted.append(Observed(ident.app_id, result.session_id, result.agent_id, spans, round_id, following))
    edges = {(app_id, src, dst) for app_id, app in inference.apps.items()
             for dst in app.graph.nodes for src in app.graph.predecessors(dst)}
    return predicted, edges


@functools.cache
def scores(name: str) -> Scores:
    header, records = load(name)
    predicted, edges = replay(records)
    return score(truth_of(records), predicted, true_edges_of(header), edges)


def test_the_suite_has_every_trace_family():
    families = {"kvcomm_2agents", "kvcomm_3agents", "kvcomm_4agents", "kvcomm_5agents", "allgather_ttsep",
                "allgather_plain", "react_tools", "reflexion", "plan_execute_review", "autogen_groupchat",
                "autogen_groupchat_selector", "two_apps_helpdesk"}
    assert families <= set(TRACE_NAMES)
    assert sum(p.stat().st_size for p in TRACES.glob("*.jsonl")) < 2 * 2**20


def test_print_the_metrics_table():
    rows = {name: scores(name) for name in TRACE_NAMES}
    print("\n" + table(rows))
    print(f"(asserted: every column but r_fwd and spur, >= {THRESHOLD}; round = min of both mapping directions, "
          "r_fwd = predicted -> true only; spur = requests given a round that belong to none)")
    assert len(rows) == len(TRACE_NAMES)


# Known shortfalls, kept visible (strict: the day they pass, the mark must go).
# Rounds: an agent is announced as a round member once its team has shown a composed
# view of outputs (kvrelay/gateway/inference/rounds.py); an app's first rounds, answered one after
# another, read like a transcript, so the rounds of every session that runs before the
# first composed view are missed: the first KVCOMM round of each session (all sessions of
# these traces start before any reaches round 2).
COLD_ROUNDS = "cold start: rounds before the app's first composed view of outputs are missed"
# Next agent: no plan can name an agent it has not yet seen follow the current one; these
# traces start all their sessions at once, so a third to a half of the agent changes come
# before any (next_agent_warm scores the rest). The selector's speaker is the model's pick.
COLD_NEXT = "cold start: an agent's first changes come before the gateway has seen any agent follow it"
SHORTFALLS = {**{(f"kvcomm_{n}agents", "round"): COLD_ROUNDS for n in (2, 3, 4, 5)},
              **{(name, "next_agent"): COLD_NEXT for name in TRACE_NAMES if name != "react_tools"},
              ("autogen_groupchat_selector", "next_agent_warm"): "the speaker is whoever the selector model names"}


def _cases() -> list:
    return [pytest.param(name, metric, marks=[pytest.mark.xfail(strict=True, reason=SHORTFALLS[(name, metric)])]
                         if (name, metric) in SHORTFALLS else [])
            for name in TRACE_NAMES for metric in METRICS]


@pytest.mark.parametrize(("name", "metric"), _cases())
def test_inference_matches_the_labels(name: str, metric: str):
    value = getattr(scores(name), metric)
    assert value >= THRESHOLD, f"{name}: {metric} = {value:.3f}"


# -- the labels themselves --------------------------------------------------------------


@pytest.mark.parametrize("name", TRACE_NAMES)
def test_labels_are_well_formed(name: str):
    header, records = load(name)
    nodes = {(app, agent) for app, edges in header["edges"].items() for edge in edges for agent in edge}
    for record in records:
        labels, messages = record["labels"], record["body"]["messages"]
        assert len(record["response"]) >= 32 or labels["agent"] == "chat_manager"
        previous = (-1, 0, 0)
        for index, start, end, placeholder in labels["placeholders"]:
            assert 0 <= start < end <= len(messages[index]["content"])
            assert (index, start) >= previous[:2] and (index != previous[0] or start >= previous[2])
            assert placeholder == "user_question" or placeholder.startswith(("agent_", "condition_"))
            previous = (index, start, end)
        if labels["round"] is not None:
            assert labels["round"].startswith(labels["session"] + "/")
        if nodes:
            assert (labels["app"], labels["agent"]) in nodes


# -- the generator ----------------------------------------------------------------------


def generator() -> ModuleType:
    module = sys.modules.get("trace_generate")
    if module is None:
        spec = importlib.util.spec_from_file_location("trace_generate", TRACES / "generate.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return module


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.jsonl"))}


def test_the_generator_is_deterministic(tmp_path: Path):
    gen = generator()
    gen.generate(tmp_path / "a", "template")
    gen.generate(tmp_path / "b", "template")
    first, second = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert first.keys() == {f"{n}.jsonl" for n in TRACE_NAMES}
    assert first == second


def test_the_committed_traces_regenerate_exactly(tmp_path: Path):
    """Model answers come from the committed cache, so this never loads the model."""
    gen = generator()
    used_model = any("model" in load(name)[0].get("answers", {}) for name in TRACE_NAMES)
    gen.generate(tmp_path, "model" if used_model else "template", cache_only=True)
    assert _files(tmp_path) == _files(TRACES)


# -- the scorer can fail ----------------------------------------------------------------


def _toy() -> tuple[list[Observed], set[Edge]]:
    def obs(session: str, agent: str, spans: tuple[tuple[int, int, int, str], ...] = (),
            round_id: str | None = None) -> Observed:
        return Observed("app", session, agent, frozenset(spans), round_id)

    truth = [obs("s1", "planner", ((1, 0, 40, "user_question"),)),
             obs("s1", "coder", ((1, 0, 40, "user_question"), (1, 50, 90, "agent_planner_current"))),
             obs("s2", "planner", ((1, 0, 45, "user_question"),)),
             obs("s2", "coder", ((1, 0, 45, "user_question"), (1, 55, 99, "agent_planner_current"))),
             obs("s1", "reviewer", ((1, 0, 40, "agent_planner_current"), (1, 50, 70, "agent_coder_current")), "s1/r2"),
             obs("s1", "tester", ((1, 0, 40, "agent_planner_current"), (1, 50, 70, "agent_coder_current")), "s1/r2")]
    return truth, {("app", "planner", "coder"), ("app", "planner", "reviewer"), ("app", "coder", "reviewer"),
                   ("app", "planner", "tester"), ("app", "coder", "tester")}


def _renamed(observed: Observed, **changes: Any) -> Observed:
    fields = {"app": observed.app, "session": observed.session, "agent": observed.agent,
              "placeholders": observed.placeholders, "round": observed.round, "next": observed.next, **changes}
    return Observed(**fields)


_IDS = {"planner": "agent-1a", "coder": "agent-2b", "reviewer": "agent-3c", "tester": "agent-4d"}


def _gateway_name(name: str) -> str:
    for agent, agent_id in _IDS.items():
        name = name.replace(f"_{agent}_", f"_{agent_id}_")
    return name


def _as_predicted(truth: list[Observed]) -> list[Observed]:
    """The truth under other ids, as the gateway would name it, each plan naming the
    agent that comes next in its session."""
    def following(i: int) -> frozenset[str]:
        later = [t for t in truth[i + 1:] if t.session == truth[i].session]
        return frozenset({_IDS[later[0].agent]}) if later else frozenset()

    return [_renamed(t, session=f"sess-{t.session}", agent=_IDS[t.agent],
                     placeholders=frozenset((m, a, b, _gateway_name(n)) for m, a, b, n in t.placeholders),
                     round=None if t.round is None else f"sess-{t.round}", next=following(i))
            for i, t in enumerate(truth)]


def _predicted_edges(edges: set[Edge]) -> set[Edge]:
    return {(app, _IDS[src], _IDS[dst]) for app, src, dst in edges}


def test_a_perfect_prediction_under_other_ids_scores_one():
    truth, edges = _toy()
    result = score(truth, _as_predicted(truth), edges, _predicted_edges(edges))
    assert all(getattr(result, m) == 1.0 for m in METRICS) and result.spurious_rounds == 0


def test_a_span_off_by_one_character_costs_precision_and_recall():
    truth, edges = _toy()
    predicted = _as_predicted(truth)
    m, a, b, n = sorted(predicted[1].placeholders)[1]
    predicted[1] = _renamed(predicted[1], placeholders=predicted[1].placeholders - {(m, a, b, n)} | {(m, a, b + 1, n)})
    result = score(truth, predicted, edges, _predicted_edges(edges))
    assert result.placeholder_precision < 1 and result.placeholder_recall < 1


def test_merging_two_agents_or_two_sessions_costs_accuracy():
    truth, edges = _toy()
    predicted = [_renamed(p, agent="agent-1a") if p.agent == "agent-2b" else p for p in _as_predicted(truth)]
    assert score(truth, predicted, edges, _predicted_edges(edges)).agent < 1
    merged = [_renamed(p, session="sess-s1") for p in _as_predicted(truth)]
    assert score(truth, merged, edges, _predicted_edges(edges)).session < 1
    assert mapped_accuracy(["x", "x"], ["a", "b"]) == 0.5 and mapped_accuracy(["x", "y"], ["a", "a"]) == 0.5


def test_wrong_rounds_and_missing_edges_cost_their_metrics():
    truth, edges = _toy()
    spurious = _as_predicted(truth)
    spurious[0] = _renamed(spurious[0], round="sess-s1/r1")
    spurious[1] = _renamed(spurious[1], round="sess-s1/r1")
    result = score(truth, spurious, edges, _predicted_edges(edges))
    assert result.round < 1 and result.spurious_rounds == 2
    split = _as_predicted(truth)
    split[5] = _renamed(split[5], round="sess-s1/r3")
    assert score(truth, split, edges, _predicted_edges(edges)).round < 1
    missed = _as_predicted(truth)
    missed[5] = _renamed(missed[5], round=None)
    result = score(truth, missed, edges, _predicted_edges(edges))
    assert result.round < 1 and result.round_forward < 1
    assert score(truth, _as_predicted(truth), edges, _predicted_edges(edges) - {("app", "agent-1a", "agent-2b")}
                 ).edge_f1 < 1


def test_naming_the_wrong_next_agent_costs_next_agent_accuracy():
    truth, edges = _toy()
    predicted = _as_predicted(truth)
    assert score(truth, predicted, edges, _predicted_edges(edges)).next_agent == 1.0
    predicted[0] = _renamed(predicted[0], next=frozenset({"agent-3c"}))  # the reviewer, not the coder
    assert score(truth, predicted, edges, _predicted_edges(edges)).next_agent < 1.0
