"""StepGraph: edges, AND/OR aggregation learned from triggers, steps-to-execution."""

from __future__ import annotations

from gateway.inference.stepgraph import StepGraph


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
