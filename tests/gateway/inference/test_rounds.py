"""Rounds: what reading shows (composed views against transcripts), passes, formed rounds,
and what the admin views show of them."""

from __future__ import annotations

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.inference.rounds import RoundDetector, read_pattern
from kvrelay.gateway.inference.views import session_detail, session_summary
from kvrelay.gateway.settings import InferenceSettings

PRODUCER = {0: "a", 1: "b", 2: "c", 3: "a", 4: "b"}
SERIES = {"a": [0, 3], "b": [1, 4], "c": [2]}


def test_outputs_read_out_of_their_order_are_a_composed_view():
    assert read_pattern([4, 3, 2], PRODUCER, SERIES) == "composed"  # this round's answers before the last's


def test_outputs_another_request_of_the_pass_read_too_are_a_composed_view():
    assert read_pattern([2, 3, 4], PRODUCER, SERIES, read_in_pass=True) == "composed"  # an All-Gather round
    assert read_pattern([3], PRODUCER, SERIES, read_in_pass=True) == "transcript"  # one output: any chain does
    assert read_pattern([0, 1, 2, 3, 4], PRODUCER, SERIES, read_in_pass=True) == "transcript"  # the whole chat


def test_outputs_read_in_order_by_agents_that_spoke_again_are_a_transcript():
    assert read_pattern([0, 1, 2, 3], PRODUCER, SERIES) == "transcript"
    assert read_pattern([2, 3, 4], PRODUCER, SERIES) == "transcript"  # a window over a transcript is one too


def test_first_outputs_read_in_order_show_nothing():
    assert read_pattern([0, 1, 2], {0: "a", 1: "b", 2: "c"}, {"a": [0], "b": [1], "c": [2]}) is None
    assert read_pattern([], PRODUCER, SERIES) is None


def test_a_pass_ends_when_an_agent_asks_again_and_members_get_the_pass_s_round():
    rounds = RoundDetector("s")
    for agent in ("a", "b", "c"):
        rounds.enter(agent)
        assert rounds.join(frozenset(), True) is None  # reads nothing: no member
    rounds.enter("b")  # b again: a new pass
    first = rounds.join(frozenset({0, 2}), True)
    rounds.enter("a")
    second = rounds.join(frozenset({1, 2}), True)
    assert first is not None and second is not None and first.id == second.id == "s/r1"
    assert (first.index, second.index, second.size) == (0, 1, 3)  # expected: the previous pass's 3 agents
    assert rounds.rest_of_round() == {"c"}
    rounds.enter("c")
    assert rounds.join(frozenset({0, 1}), False) is None  # its agent does not expect rounds
    rounds.enter("a")
    lone = rounds.join(frozenset({5}), True)
    assert lone is not None and lone.id == "s/r2"
    assert [r.id for r in rounds.formed()] == ["s/r1"]  # a round of one request did not form


def _plan(inference: Inference, system: str, user: str, request_id: str):
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    return inference.plan(identify({"x-session-id": "s"}, body, None), body, request_id, "m")


def test_a_debate_s_second_round_forms_and_the_admin_view_shows_only_formed_rounds():
    """Three agents answer in turn; in round 2 each reads this round's answers first, then
    the last round's: a composed view, so round 2 forms (round 1 reads like a transcript)."""
    inference = Inference(InferenceSettings())
    agents = {n: f"You are debater number {n} of three. Argue briefly and concretely." for n in (1, 2, 3)}
    task = "Should the town build a second bridge over the river, or widen the old one?"
    said: dict[tuple[int, int], str] = {}
    plans = []
    for r in (1, 2):
        for n in (1, 2, 3):
            this_round = [said[(r, m)] for m in (1, 2, 3) if m < n]
            last_round = [said[(r - 1, m)] for m in (1, 2, 3) if m != n and r > 1]
            prompt = "\n\n".join([task, *this_round, *last_round])
            plan = _plan(inference, agents[n], prompt, f"r{r}{n}")
            said[(r, n)] = f"Debater {n}, round {r}: the bridge question turns on traffic, cost and the river banks."
            inference.observe_response("default", "s", plan.agent_id, f"r{r}{n}", said[(r, n)])
            plans.append(plan.plan)
    # Debater 1's round-2 prompt reads the others' first answers in order: nothing shown yet.
    # Debater 2 reads debater 1's new answer before debater 3's old one: composed.
    assert [p.round.id if p.round else None for p in plans] == [None, None, None, None, "s/r1", "s/r1"]
    session = inference.apps["default"].sessions["s"]
    detail = session_detail(inference.apps["default"], "default", session)
    assert [r["id"] for r in detail["rounds"]] == ["s/r1"] and session_summary("default", session)["num_rounds"] == 1
