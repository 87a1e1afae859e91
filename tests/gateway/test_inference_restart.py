"""A gateway restarted mid-session continues it: rounds, placeholders and the step graph."""

from __future__ import annotations

import random

from kvrelay.wire.plan import SegmentPlan
from tests.gateway.village import NUM_AGENTS, Round, clients_for, village_round


def _round(gw, fake, r: int, outputs: list[str], rng: random.Random, headers: dict[str, str]) -> Round:
    return village_round(clients_for([gw]), fake, r, outputs, rng, headers)


def _covered(plan: SegmentPlan, body: dict, kind: str) -> dict[str, str]:
    return {s.name or s.content_hash: body["messages"][s.message_index]["content"][s.char_start:s.char_end]
            for s in plan.segments if s.kind == kind}


def _run(gw_first, start_gateway, fake, headers: dict[str, str]) -> None:
    rng = random.Random(3)
    first, _, outputs = _round(gw_first, fake, 0, [], rng, headers)
    second, _, outputs = _round(gw_first, fake, 1, outputs, rng, headers)
    gw_first.server.stop()  # lifespan exit: the last changes are saved

    gw = start_gateway([fake.url], db_path=gw_first.db_path)
    third, bodies, _ = _round(gw, fake, 2, outputs, rng, headers)

    assert {p.session_id for p in first + second + third} == {first[0].session_id}
    assert [p.agent_id for p in third] == [p.agent_id for p in first]  # agents recognised by their system prompts
    assert [p.round.index for p in third] == [0, 1, 2] and {p.round.size for p in third} == {3}
    # Each villager reads the last round in its own shuffled order: a composed view, a round at once.
    assert [p.round.index for p in second] == [0, 1, 2]
    assert third[0].round.id != second[1].round.id and third[0].round.id.endswith("/r2")  # the passes came back
    for plan, body in zip(third, bodies):
        quoted = _covered(plan, body, "placeholder")
        assert sorted(quoted) == sorted(f"agent_{p.agent_id}_current" for p in first)
        assert sorted(quoted.values()) == sorted(outputs)
        assert _covered(plan, body, "fixed_prefix")  # the fixed system prefix survived too
    assert third[0].workflow.steps_to_execution  # the step graph came back with the agents


def test_a_session_named_by_header_continues_after_a_restart(fake_upstream, start_gateway):
    fake = fake_upstream()
    _run(start_gateway([fake.url]), start_gateway, fake, {"x-session-id": "town-7"})


def test_a_session_found_by_content_continues_after_a_restart(fake_upstream, start_gateway):
    fake = fake_upstream()
    _run(start_gateway([fake.url]), start_gateway, fake, {})


def test_a_session_pushed_out_of_memory_is_restored_on_its_next_request(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url], inference={"max_sessions": 1, "flush_interval_s": 0.05})
    rng = random.Random(5)
    _, _, outputs = _round(gw, fake, 0, [], rng, {"x-session-id": "town-1"})
    _round(gw, fake, 0, [], random.Random(6), {"x-session-id": "town-2"})  # pushes town-1 out
    assert not gw.state.inference.has_session("default", "town-1")
    plans, _, _ = _round(gw, fake, 1, outputs, rng, {"x-session-id": "town-1"})
    # The first reader's shuffle kept the order the outputs came in: it reads like a transcript, and
    # only the second (out of order) shows the round; the session's pass came back from SQL.
    assert [p.round.index if p.round else None for p in plans] == [None, 0, 1]
    assert all(len([s for s in p.segments if s.kind == "placeholder"]) == NUM_AGENTS for p in plans)
