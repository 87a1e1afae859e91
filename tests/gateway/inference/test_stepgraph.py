"""StepGraph: edges, AND/OR aggregation learned from triggers, steps-to-execution (equal to
references written from the definitions, linear in the graph), and its bounds."""

from __future__ import annotations

import random
from collections import Counter

from kvrelay.gateway.inference.budget import Deadline
from kvrelay.gateway.inference.stepgraph import StepGraph
from tests.helpers import LINEAR_RATIO_BOUND, cpu_ratio


def test_dataflow_edges_win_over_succession_and_self_reads_are_ignored():
    g = StepGraph()
    g.observe("a", set(), set(), None)
    g.observe("b", {"a", "b"}, {"a"}, "a")
    g.observe("c", set(), set(), "b")  # reads nothing: only succession
    assert g.edges() == [("a", "b", "dataflow"), ("b", "c", "succession")]
    assert g.predecessors("b") == {"a"} and g.predecessors("c") == {"b"}


def test_waiting_for_all_predecessors_is_and_and_any_one_is_or():
    g = StepGraph()
    for agent in ("x", "y"):
        g.observe(agent, set(), set(), None)
    g.observe("join", {"x", "y"}, {"x", "y"}, "y")
    assert g.aggregation("join") == "and"
    g.observe("join", {"x", "y"}, {"x"}, "x")  # ran when only x had something new
    assert g.aggregation("join") == "or"


def test_steps_use_max_for_and_and_min_for_or():
    g = StepGraph()
    g.observe("start", set(), set(), None)
    g.observe("fast", {"start"}, {"start"}, "start")
    g.observe("slow1", {"start"}, {"start"}, "start")
    g.observe("slow2", {"slow1"}, {"slow1"}, "slow1")
    g.observe("and_join", {"fast", "slow2"}, {"fast", "slow2"}, "slow2")
    g.observe("or_join", {"fast", "slow2"}, {"fast"}, "fast")
    g.observe("or_join", {"fast", "slow2"}, {"slow2"}, "slow2")
    steps = g.steps_to_execution("start")
    assert steps == {"start": 0, "fast": 1, "slow1": 1, "slow2": 2, "and_join": 3, "or_join": 2}
    assert g.workflow("start").next == ["fast", "slow1"]


def test_a_loop_terminates_and_unreachable_agents_are_left_out():
    g = StepGraph()
    g.observe("p", {"r"}, {"r"}, "r")
    g.observe("c", {"p"}, {"p"}, "p")
    g.observe("r", {"c"}, {"c"}, "c")
    g.observe("lonely", set(), set(), None)
    assert g.steps_to_execution("c") == {"c": 0, "r": 1, "p": 2}


def test_mermaid_draws_and_nodes_as_rhombi_and_succession_dotted():
    g = StepGraph()
    g.observe("x", set(), set(), None)
    g.observe("y", set(), set(), None)
    g.observe("j", {"x", "y"}, {"x", "y"}, "y")
    g.observe("k", set(), set(), "j")
    text = g.mermaid()
    assert text.splitlines()[0] == "flowchart LR"
    # sorted: j=n0, k=n1, x=n2, y=n3
    assert '    n0{"j"}' in text and '    n2["x"]' in text
    assert "    n2 --> n0" in text and "    n0 -.-> n1" in text


def test_mermaid_keeps_free_text_agent_ids_from_breaking_the_chart_and_can_show_a_part():
    g = StepGraph()
    g.observe('say "hi"', set(), set(), None)
    g.observe("a-b", {'say "hi"'}, {'say "hi"'}, 'say "hi"')
    g.observe("a_b", {"a-b"}, {"a-b"}, "a-b")
    text = g.mermaid()
    assert '["say #quot;hi#quot;"]' in text and '"a-b"' in text and '"a_b"' in text
    assert len({line.split("[")[0] for line in text.splitlines()[1:4]}) == 3  # distinct node ids
    part = g.mermaid({"a-b", "a_b", "absent"})
    assert "say" not in part and part.count("-->") == 1


# -- steps-to-execution against references written from the definitions -----------------------

def _random_graph(rng: random.Random) -> tuple[StepGraph, list[str]]:
    """A small graph learned through `observe`, with loops, AND joins and succession edges."""
    names = [f"a{i}" for i in range(rng.randrange(1, 8))]
    g = StepGraph()
    for _ in range(rng.randrange(0, 18)):
        read = set(rng.sample(names, rng.randrange(0, min(3, len(names)) + 1)))
        fresh = {a for a in read if rng.random() < 0.7}
        g.observe(rng.choice(names), read, fresh, rng.choice([*names, None]))
    return g, names


def _reachable_avoiding(g: StepGraph, start: str, avoid: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        at = todo.pop()
        for agent in g.nodes:
            if at in g.step_predecessors(agent) and agent != avoid and agent not in seen:
                seen.add(agent)
                todo.append(agent)
    return seen


def _waits_for(g: StepGraph, agent: str, current: str) -> set[str]:
    return set(g.step_predecessors(agent)) & _reachable_avoiding(g, current, agent)


def _reference_steps(g: StepGraph, current: str) -> dict[str, int]:
    """The documented semantics, by brute force: repeatedly give the smallest step any
    agent can get from the agents already given one (OR: first predecessor + 1, AND: last
    of those it waits for + 1); when none can, the waiting AND agent whose reached
    predecessors ran earliest (then: most often after `current`, then name) goes first."""
    steps = {current: 0}
    while True:
        offers = {}
        for agent in g.nodes:
            preds = g.step_predecessors(agent)
            if agent in steps or not preds:
                continue
            if g.aggregation(agent) == "or":
                known = [steps[p] for p in preds if p in steps]
                if known:
                    offers[agent] = min(known) + 1
            else:
                waits = _waits_for(g, agent, current)
                if waits and waits <= steps.keys():
                    offers[agent] = max(steps[p] for p in waits) + 1
        if offers:
            low = min(offers.values())
            steps.update({agent: step for agent, step in offers.items() if step == low})
            continue
        waiting = [a for a in g.nodes if a not in steps and g.step_predecessors(a) & steps.keys()]
        if not waiting:
            return steps
        first = min(waiting, key=lambda a: (max(steps[p] for p in g.step_predecessors(a) & steps.keys()),
                                            -g.nodes[a].succession[current], a))
        steps[first] = max(steps[p] for p in g.step_predecessors(first) & steps.keys()) + 1


def _relaxed_steps(g: StepGraph, current: str) -> dict[str, int] | None:
    """The fixed point of the step equations by plain relaxation; None when it leaves an
    agent waiting that some reached agent feeds (a loop only a tie-break can open)."""
    steps = {current: 0}
    changed = True
    while changed:
        changed = False
        for agent in g.nodes:
            preds = g.step_predecessors(agent)
            if agent == current or not preds:
                continue
            if g.aggregation(agent) == "or":
                known = [steps[p] for p in preds if p in steps]
                value = min(known) + 1 if known else None
            else:
                waits = _waits_for(g, agent, current)
                value = max(steps[p] for p in waits) + 1 if waits and waits <= steps.keys() else None
            if value is not None and value < steps.get(agent, value + 1):
                steps[agent], changed = value, True
    if any(a not in steps and g.step_predecessors(a) & steps.keys() for a in g.nodes):
        return None
    return steps


def test_steps_equal_the_brute_force_reference_on_random_graphs():
    rng = random.Random(11)
    for _ in range(1500):
        g, names = _random_graph(rng)
        for current in names:
            if current in g.nodes:
                assert g.steps_to_execution(current) == _reference_steps(g, current), (g.edges(), current)


def test_without_a_waiting_loop_the_steps_are_the_fixed_point_of_the_equations():
    rng = random.Random(12)
    compared = 0
    for _ in range(1500):
        g, names = _random_graph(rng)
        for current in names:
            relaxed = _relaxed_steps(g, current) if current in g.nodes else None
            if relaxed is not None:
                assert g.steps_to_execution(current) == relaxed
                compared += 1
    assert compared > 1000


def _ring(n: int) -> StepGraph:
    """A ring of n agents where every third one also reads from one 2-20 places back and
    waits for both (AND): each joins a loop back through itself."""
    g = StepGraph()
    for i in range(n):
        sources = {f"r{(i - 1) % n}"} | ({f"r{(i - 2 - i % 19) % n}"} if i % 3 == 0 else set())
        g.observe(f"r{i}", sources, sources, None)
    return g


def test_a_limit_keeps_the_nearest_agents_with_their_full_steps():
    g = _ring(300)
    full = g.steps_to_execution("r5")
    assert len(full) == 300
    near = g.steps_to_execution("r5", limit=40)
    assert len(near) == 40 and all(full[a] == s for a, s in near.items())
    assert max(near.values()) <= min(s for a, s in full.items() if a not in near)
    assert len(g.workflow("r5", limit=40).steps_to_execution) == 40


def test_a_passed_deadline_returns_what_was_reached():
    g = _ring(300)
    steps = g.steps_to_execution("r5", deadline=Deadline(0.0))
    assert 1 <= len(steps) < 300 and steps["r5"] == 0


def test_steps_cost_time_linear_in_the_graph():
    small, large = _ring(1_000), _ring(4_000)
    ratio = cpu_ratio(lambda: small.steps_to_execution("r0"), lambda: large.steps_to_execution("r0"))
    assert ratio < LINEAR_RATIO_BOUND, f"4x the agents took {ratio:.1f}x the time"


# -- bounds ------------------------------------------------------------------------------------

def test_removing_an_agent_takes_its_edges_and_predecessors_fall_back_to_succession():
    g = StepGraph()
    g.observe("a", set(), set(), None)
    g.observe("b", set(), set(), "a")
    g.observe("c", {"a"}, {"a"}, "b")  # dataflow from a; succession from b
    assert g.predecessors("c") == {"a"}
    g.remove("a")
    assert "a" not in g.nodes and ("a", "b", "succession") not in g.edges()
    assert g.predecessors("c") == {"b"} and g.predecessors("b") == set()
    assert g.steps_to_execution("b") == {"b": 0, "c": 1}


def test_a_node_keeps_at_most_max_sources_of_each_kind_and_counts_the_rest():
    bounded: Counter[str] = Counter()
    g = StepGraph(max_sources=3, bounded=bounded)
    g.observe("join", {f"s{i}" for i in range(5)}, set(), None)
    assert len(g.predecessors("join")) == 3 and bounded["step_edges_not_kept"] == 2


def test_in_a_transcript_the_steps_follow_who_ran_after_whom():
    """A round-robin chat: every agent reads every other, so reading says nothing of the
    order; the steps walk the sources each agent also ran right after."""
    g = StepGraph()
    g.observe("planner", set(), set(), None)
    g.observe("writer", {"planner"}, {"planner"}, "planner")
    g.observe("critic", {"planner", "writer"}, {"planner", "writer"}, "writer")
    g.observe("planner", {"writer", "critic"}, {"writer", "critic"}, "critic")
    g.observe("writer", {"planner", "critic"}, {"planner", "critic"}, "planner")
    assert g.predecessors("planner") == {"writer", "critic"}  # the edges: who reads whom
    assert g.step_predecessors("planner") == {"critic"} and g.step_predecessors("writer") == {"planner"}
    assert g.workflow("critic").next == ["planner"]
    assert g.workflow("planner").next == ["writer"]
