"""WorkflowTable: priority propagation over shared prefixes, concurrent workflows, finished and upcoming agents."""

from __future__ import annotations

import math

import pytest

from engine_ext.tiers.workflow import AgentKey, UpcomingAgent, WorkflowTable
from tests.engine_ext.tiers import ring


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("a_first", [True, False])
def test_shared_prefix_blocks_take_the_smallest_steps(a_first: bool) -> None:
    table = WorkflowTable()
    a, b = AgentKey("app", "a"), AgentKey("app", "b")
    shared = (h(0), h(1))
    steps = {"a": 1, "b": 5}
    observations = [(a, shared + (h(10), h(11))), (b, shared + (h(20),))]
    for i, (agent, prefix) in enumerate(observations if a_first else observations[::-1]):
        table.observe(agent, prefix, steps if i == 0 else None)  # one plan for the app
    assert table.steps(a) == 1 and table.steps(b) == 5
    assert [table.priority(x) for x in shared] == [1, 1]  # min(1, 5), whoever came first
    assert [table.priority(x) for x in (h(10), h(11))] == [1, 1]
    assert table.priority(h(20)) == 5  # b's own block keeps b's steps
    assert table.priority(h(99)) is None  # in no prefix


def test_private_blocks_keep_their_agents_steps_when_the_shared_one_is_far() -> None:
    table = WorkflowTable()
    a, b = AgentKey("app", "a"), AgentKey("app", "b")
    table.observe(a, (h(0), h(1), h(2)), {"a": 7, "b": 2})
    table.observe(b, (h(0), h(1), h(3)), None)
    assert [table.priority(x) for x in (h(0), h(1), h(2), h(3))] == [2, 2, 7, 2]


def test_concurrent_workflows_take_the_most_conservative_steps() -> None:
    table = WorkflowTable()
    x, y = AgentKey("x", "planner"), AgentKey("y", "planner")
    table.observe(x, (h(0), h(1)), {"planner": 4})
    table.observe(y, (h(0), h(2)), {"planner": 2})
    assert (table.priority(h(0)), table.priority(h(1)), table.priority(h(2))) == (2, 4, 2)
    # a newer plan of y (no prefix this time: the known one stays) invalidates the cache
    table.observe(y, None, {"planner": 7})
    assert (table.priority(h(0)), table.priority(h(1)), table.priority(h(2))) == (4, 4, 7)
    table.observe(x, None, {"planner": 0})
    assert (table.priority(h(0)), table.priority(h(1)), table.priority(h(2))) == (0, 0, 7)
    assert table.steps(y) == 7  # x's plan does not touch y's


def test_observe_copies_the_steps_map() -> None:
    table = WorkflowTable()
    agent = AgentKey("app", "a")
    steps = {"a": 3}
    table.observe(agent, (h(0),), steps)
    steps["a"] = 0  # the caller's dict changing later is not a new plan
    assert table.steps(agent) == 3
    assert table.priority(h(0)) == 3


def test_a_plan_that_drops_an_agent_makes_its_steps_unknown() -> None:
    table = WorkflowTable()
    a, b = AgentKey("app", "a"), AgentKey("app", "b")
    table.observe(a, (h(0),), {"a": 1, "b": 2})
    table.observe(b, (h(1),), None)
    assert table.priority(h(1)) == 2
    table.observe(a, None, {"a": 1})
    assert table.steps(b) == math.inf
    assert table.priority(h(1)) == math.inf


def test_finished_agent_moves_behind_every_other_agent_of_its_app() -> None:
    table = WorkflowTable()
    a, b, c = AgentKey("app", "a"), AgentKey("app", "b"), AgentKey("app", "c")
    other = AgentKey("other", "a")  # same agent id, another app
    table.observe(a, (h(0),), {"a": 0, "b": 2, "c": 5})
    table.observe(other, (h(9),), {"a": 0})
    assert table.priority(h(0)) == 0  # fills the cache
    table.finished(a)
    assert table.steps(a) == 6  # max(2, 5) + 1
    assert table.priority(h(0)) == 6  # the cache was invalidated
    assert (table.steps(b), table.steps(c)) == (2, 5)
    assert table.steps(other) == 0 and table.priority(h(9)) == 0
    table.finished(c)
    assert table.steps(c) == 7  # behind a's 6, not behind its own old 5


def test_finished_alone_and_without_a_plan() -> None:
    table = WorkflowTable()
    solo = AgentKey("solo", "only")
    table.observe(solo, (h(0),), {"only": 0})
    table.finished(solo)
    assert table.steps(solo) == 1  # no other agent: max(default 0) + 1

    planless = AgentKey("planless", "a")
    table.observe(planless, (h(1),), None)
    table.finished(planless)  # no steps map: nothing to reorder
    assert table.steps(planless) == math.inf
    assert table.priority(h(1)) == math.inf
    assert table.upcoming(64) == [UpcomingAgent(1, solo, (h(0),))]


def test_unknown_steps_is_infinity() -> None:
    table = WorkflowTable()
    agent = AgentKey("app", "a")
    assert table.steps(agent) == math.inf
    table.observe(agent, (h(0),), None)
    assert table.steps(agent) == math.inf
    assert table.priority(h(0)) == math.inf
    table.observe(AgentKey("app", "b"), None, {"b": 1})  # a plan without a
    assert table.steps(agent) == math.inf


def test_upcoming_lists_known_prefixes_due_within_load_ahead_soonest_first() -> None:
    table = WorkflowTable()
    a, b, c, d = (AgentKey("app", n) for n in "abcd")
    e = AgentKey("other", "e")
    table.observe(a, (h(0),), {"a": 2, "b": 0, "c": 1, "d": 5})
    table.observe(b, (h(1), h(2)), None)
    table.observe(d, (h(3),), None)
    table.observe(c, (), None)  # an empty prefix is no prefix: c stays unknown
    table.observe(e, (h(4),), None)  # no plan: never upcoming
    assert table.upcoming(2) == [UpcomingAgent(0, b, (h(1), h(2))), UpcomingAgent(2, a, (h(0),))]
    assert table.upcoming(0) == [UpcomingAgent(0, b, (h(1), h(2)))]
    assert [u.agent for u in table.upcoming(64)] == [b, a, d]
    assert all(isinstance(u.steps, int) for u in table.upcoming(64))
    assert table.upcoming(-1) == []
    table.finished(b)  # b just ran: it is now 6 steps away
    assert [u.agent for u in table.upcoming(5)] == [a, d]


def test_an_idle_app_is_forgotten_and_stops_ranking_its_prefixes() -> None:
    now = [0.0]
    table = WorkflowTable(idle_s=60.0, clock=lambda: now[0])
    table.observe(AgentKey("old", "a"), (b"old-block",), {"a": 1})
    now[0] = 30.0
    table.observe(AgentKey("live", "b"), (b"live-block",), {"b": 2})
    assert table.priority(b"old-block") == 1 and table.priority(b"live-block") == 2
    now[0] = 61.0  # "old" has been silent for 61 s, "live" for 31 s
    assert [u.agent for u in table.upcoming(5)] == [AgentKey("live", "b")]
    assert table.priority(b"old-block") is None and table.steps(AgentKey("old", "a")) == math.inf
    assert table.priority(b"live-block") == 2


def test_sessions_of_one_app_each_keep_their_own_steps() -> None:
    """Two workflow instances of one app at different steps: each agent's prefix is
    ranked by the session that needs it soonest, not by whichever plan came last."""
    table = WorkflowTable()
    a, b, c = (AgentKey("app", n) for n in "abc")
    table.observe(a, (h(0), h(9)), {"a": 0, "b": 1, "c": 2}, session="s1")
    table.observe(c, (h(2), h(9)), {"c": 0, "a": 1, "b": 2}, session="s2")
    table.observe(b, (h(1),), {"b": 0, "c": 1, "a": 2}, session="s3")
    assert [table.steps(x) for x in (a, b, c)] == [0, 0, 0]
    table.finished(b, session="s3")  # s3 goes on to c; s1 still runs a now, s2 c
    assert [table.steps(x) for x in (a, b, c)] == [0, 1, 0]
    table.finished(a, session="s1")
    table.finished(c, session="s2")
    assert [table.steps(x) for x in (a, b, c)] == [1, 1, 1]  # each is some session's next
    assert table.priority(h(9)) == 1  # shared by a and c


def test_a_session_s_prefixes_go_only_with_its_app_s_last_live_session() -> None:
    now = [0.0]
    table = WorkflowTable(idle_s=60.0, clock=lambda: now[0])
    a = AgentKey("app", "a")
    table.observe(a, (h(0),), {"a": 3}, session="old")
    now[0] = 30.0
    table.observe(a, None, {"a": 5}, session="new")
    assert table.priority(h(0)) == 3
    now[0] = 61.0  # "old" is idle, "new" is not: the prefix stays, ranked by "new"
    assert table.upcoming(5) == [UpcomingAgent(5, a, (h(0),))]
    assert table.priority(h(0)) == 5
    now[0] = 91.0
    assert table.upcoming(64) == [] and table.priority(h(0)) is None


def test_the_session_cap_bounds_what_is_tracked() -> None:
    table = WorkflowTable(max_sessions=2)
    for i in range(5):
        table.observe(AgentKey(f"app{i}", "a"), (h(i),), {"a": 1}, session=f"s{i}")
    assert len(table.sessions) == 2
    assert [table.priority(h(i)) for i in range(5)] == [None, None, None, 1, 1]  # the oldest apps' prefixes went


def _ring_table_replay(named_sessions: bool) -> tuple[int, int]:
    table = WorkflowTable()

    def run(session: int, agent: int) -> None:
        key, name = AgentKey("app", ring.AGENTS[agent]), f"s{session}" if named_sessions else None
        table.observe(key, (h(agent),), ring.ring_steps(agent), session=name)
        table.finished(key, session=name)

    return ring.replay(run, lambda: {u.agent.agent_id for u in table.upcoming(ring.LOAD_AHEAD)})


def test_three_out_of_phase_sessions_each_find_their_next_agent_within_load_ahead() -> None:
    passed, checks = _ring_table_replay(named_sessions=True)
    assert checks == 144
    assert passed / checks >= 0.95
    assert passed == checks  # each session's plan puts its next agent at 1


def test_one_map_per_app_loses_the_other_sessions_next_agents() -> None:
    """The same requests without session ids: one unnamed instance per app, the last plan
    wins (the behaviour before steps were kept per session). The check must tell them apart."""
    passed, checks = _ring_table_replay(named_sessions=False)
    assert passed / checks < 0.95
