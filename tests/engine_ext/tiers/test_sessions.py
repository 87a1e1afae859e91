"""WorkflowSessions: steps-to-execution per (app, session), the minimum over live sessions,
idle expiry per session, the cap on tracked sessions, and the incremental minimum."""

from __future__ import annotations

import math
import random

import pytest

from engine_ext.tiers.sessions import SessionKey, WorkflowSessions

S1, S2, S3 = (SessionKey("app", f"s{i}") for i in (1, 2, 3))


def test_an_agent_s_steps_are_the_minimum_over_the_app_s_sessions() -> None:
    sessions = WorkflowSessions()
    sessions.observe(S1, {"a": 0, "b": 1, "c": 2})
    sessions.observe(S2, {"c": 0, "a": 1, "b": 2})
    assert [sessions.steps("app", x) for x in "abc"] == [0, 1, 0]
    sessions.observe(S1, {"b": 0, "c": 1, "a": 2})  # S1 moved on; S2's map is untouched
    assert [sessions.steps("app", x) for x in "abc"] == [1, 0, 0]
    assert sessions.steps("app", "zzz") == math.inf
    assert sessions.steps("other", "a") == math.inf  # another app's sessions never count


def test_finished_reorders_only_its_own_session() -> None:
    sessions = WorkflowSessions()
    sessions.observe(S1, {"a": 0, "b": 1, "c": 2})
    sessions.observe(S2, {"a": 0, "b": 1, "c": 2})
    assert sessions.finished(S1, "a")
    assert sessions.steps("app", "a") == 0  # S2 still runs a now
    assert sessions.finished(S2, "a")
    assert sessions.steps("app", "a") == 3  # behind b (1) and c (2) in both
    assert not sessions.finished(SessionKey("app", "planless"), "a")  # no plan: nothing to reorder


def test_a_planless_request_keeps_the_session_s_map_and_keeps_it_live() -> None:
    now = [0.0]
    sessions = WorkflowSessions(idle_s=10.0, clock=lambda: now[0])
    sessions.observe(S1, {"a": 1})
    now[0] = 8.0
    sessions.observe(S1, None)
    now[0] = 15.0
    assert sessions.expire() == set()  # seen at 8 s: not idle yet
    assert sessions.steps("app", "a") == 1


def test_idle_sessions_expire_one_by_one_and_the_app_goes_with_the_last() -> None:
    now = [0.0]
    sessions = WorkflowSessions(idle_s=10.0, clock=lambda: now[0])
    sessions.observe(S1, {"a": 0})
    now[0] = 5.0
    sessions.observe(S2, {"a": 3})
    now[0] = 11.0
    assert sessions.expire() == set()  # S1 went, S2 keeps the app live
    assert sessions.steps("app", "a") == 3 and len(sessions) == 1 and sessions.has_app("app")
    now[0] = 16.0
    assert sessions.expire() == {"app"}
    assert sessions.steps("app", "a") == math.inf and not sessions.has_app("app") and len(sessions) == 0


def test_past_the_cap_the_least_recently_seen_session_is_dropped() -> None:
    now = [0.0]
    sessions = WorkflowSessions(max_sessions=2, clock=lambda: now[0])
    sessions.observe(S1, {"a": 0})
    sessions.observe(SessionKey("other", "x"), {"b": 0})
    now[0] = 1.0
    sessions.observe(S1, {"a": 1})  # S1 seen again: "other"'s session is now the oldest
    assert sessions.observe(S3, {"a": 5}) == {"other"}
    assert len(sessions) == 2 and not sessions.has_app("other") and sessions.steps("other", "b") == math.inf
    assert sessions.observe(S2, {"a": 7}) == set()  # S1 dropped; S3 keeps the app
    assert sessions.steps("app", "a") == 5


def test_max_sessions_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_sessions"):
        WorkflowSessions(max_sessions=0)


def test_the_incremental_minimum_matches_a_full_scan() -> None:
    """Random plans, finishes, expiries and drops: steps() always equals the minimum over
    the surviving sessions' maps, computed from scratch."""
    rng = random.Random(7)
    now = [0.0]
    sessions = WorkflowSessions(idle_s=30.0, max_sessions=6, clock=lambda: now[0])
    keys = [SessionKey(app, f"s{i}") for app in ("x", "y") for i in range(5)]
    agents = [f"a{i}" for i in range(5)]
    maps: dict[SessionKey, dict[str, int]] = {}
    seen: dict[SessionKey, float] = {}
    for _ in range(2000):
        now[0] += rng.uniform(0.0, 4.0)
        key = rng.choice(keys)
        if rng.random() < 0.3 and key in maps:
            agent = rng.choice(agents)
            sessions.finished(key, agent)
            others = [s for a, s in maps[key].items() if a != agent]
            maps[key] = {**maps[key], agent: max(others, default=0) + 1}
        else:
            steps = {a: rng.randint(0, 6) for a in rng.sample(agents, rng.randint(0, len(agents)))}
            sessions.observe(key, steps)
            maps[key], seen[key] = steps, now[0]
            while len(seen) > 6:  # the cap: the least recently seen goes
                oldest = min(seen, key=seen.__getitem__)
                del seen[oldest]
                maps.pop(oldest, None)
        sessions.expire()
        for gone in [k for k, t in seen.items() if t < now[0] - 30.0]:
            del seen[gone]
            maps.pop(gone, None)
        for app in ("x", "y"):
            for agent in agents:
                expected = min((m[agent] for k, m in maps.items() if k.app_id == app and agent in m), default=math.inf)
                assert sessions.steps(app, agent) == expected
            assert sessions.has_app(app) == any(k.app_id == app for k in seen)
