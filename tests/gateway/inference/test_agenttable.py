"""AgentTable: the agents of an app stay within `max_agents` (least recently used out,
counted, their step-graph node gone, learned again on return), and a prompt finds its
agent by index: the same agent a scan of every agent would pick, comparing at most a
bounded number of candidates however many agents the app has."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference, agenttable
from kvrelay.gateway.inference.agents import resolve_agent
from kvrelay.gateway.inference.agenttable import MAX_COMPARED, AgentState
from kvrelay.gateway.inference.prefix import PrefixLearner
from kvrelay.gateway.inference.state import AppState
from kvrelay.gateway.settings import InferenceSettings


def _system(i: int) -> str:
    return f"You are agent number {i} of the team; you answer for yourself. Be brief."


def _plan(inference: Inference, system: str, session: str = "s"):
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "go on"}]}
    return inference.plan(identify({"x-session-id": session}, body, None), body, "r", "m")


def test_agents_beyond_the_bound_leave_least_recently_used_first_and_are_counted():
    inference = Inference(InferenceSettings(max_agents=3))
    ids = [_plan(inference, _system(i)).agent_id for i in range(3)]
    _plan(inference, _system(0))  # agent 0 used again: agent 1 is now the least recently used
    fourth = _plan(inference, _system(3)).agent_id
    agents = inference.apps["default"].agents
    assert list(agents) == [ids[2], ids[0], fourth]
    assert inference.bounded["agents_evicted"] == 1


def test_an_evicted_agent_leaves_the_step_graph_and_is_learned_again_on_return():
    inference = Inference(InferenceSettings(max_agents=2))
    first = _plan(inference, _system(0)).agent_id
    second = _plan(inference, _system(1)).agent_id
    graph = inference.apps["default"].graph
    assert graph.predecessors(second) == {first}  # it ran right after the first
    _plan(inference, _system(2))  # pushes the first out
    assert first not in graph.nodes and graph.predecessors(second) == set()
    again = _plan(inference, _system(0)).agent_id
    assert again == first and inference.apps["default"].agents[first].prefix.hits == 1


def test_the_step_graph_keeps_to_the_agents_in_memory():
    inference = Inference(InferenceSettings(max_agents=50))
    for i in range(400):
        _plan(inference, _system(i), session=f"s{i % 7}")
    app = inference.apps["default"]
    assert len(app.agents) == 50 and set(app.graph.nodes) <= set(app.agents)
    assert all(src in app.agents and dst in app.agents for src, dst, _ in app.graph.edges())


def _scan(agents: list[AgentState], system_text: str, model: str, ratio: float) -> AgentState | None:
    """The rule of agents.py, by scanning every agent (the first learned wins a tie)."""
    best, best_chars = None, 0
    for agent in agents:
        candidate = agent.prefix.candidate
        if agent.model != model or candidate is None:
            continue
        chars = next((i for i, (a, b) in enumerate(zip(candidate, system_text)) if a != b),
                     min(len(candidate), len(system_text)))
        fixed = agent.prefix.fixed
        if not (fixed is not None and system_text.startswith(fixed)) and (
                chars < ratio * len(candidate) or chars < agent.prefix.min_chars):
            continue
        if chars > best_chars:
            best, best_chars = agent, chars
    return best


@pytest.mark.parametrize("ratio", [0.5, 0.9, 1.0])
def test_the_index_finds_the_agent_a_scan_of_every_agent_finds(ratio):
    rng = random.Random(int(ratio * 10))
    for _ in range(300):
        app = AppState(6, 1e9, 100, max_agents=10_000, same_agent_ratio=ratio)
        learned: list[AgentState] = []
        stems = ["".join(rng.choice("ab |") for _ in range(rng.randrange(0, 12))) for _ in range(4)]
        for _ in range(25):
            model = rng.choice(["m1", "m2"])
            text = rng.choice(stems) + "".join(rng.choice("ab |") for _ in range(rng.randrange(0, 6)))
            expected = _scan(learned, text, model, ratio)
            agent = resolve_agent(app, None, text, model, lambda: PrefixLearner(2, 6, ("|",)))
            if expected is not None:
                assert agent is expected, (text, [a.prefix.candidate for a in learned])
            elif agent not in learned:
                learned.append(agent)
            agent.prefix.observe(text)
            app.agents.refile(agent)


def test_thousands_of_agents_cost_a_bounded_number_of_comparisons(monkeypatch):
    compared = Counter()
    real = agenttable.common_prefix_len

    def counting(a: str, b: str, i: int = 0, j: int = 0) -> int:
        compared["calls"] += 1
        return real(a, b, i, j)

    monkeypatch.setattr(agenttable, "common_prefix_len", counting)
    inference = Inference(InferenceSettings(max_agents=5_000))
    for i in range(5_000):
        _plan(inference, _system(i), session=f"s{i}")
    compared.clear()
    _plan(inference, _system(4_321), session="again")
    assert compared["calls"] <= 2  # its own head leads straight to it
    # A preamble longer than the head every agent is filed under: one crowded bucket.
    preamble = "All agents of this team share these long rules. " * 8
    for i in range(200):
        _plan(inference, preamble + _system(i), session=f"p{i}")
    compared.clear()
    _plan(inference, preamble + _system(7), session="again")
    assert compared["calls"] <= MAX_COMPARED and inference.bounded["agent_matches_cut"] >= 1
