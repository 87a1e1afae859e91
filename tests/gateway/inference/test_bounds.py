"""The inference state stays bounded whatever clients send: apps and sessions leave
memory least recently used first, a session keeps at most so many texts, a plan of
countless pieces is not sent; each cut is counted."""

from __future__ import annotations

import pytest

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.settings import InferenceSettings


def _plan(inference: Inference, headers: dict[str, str], content: str, request_id: str = "r"):
    body = {"messages": [{"role": "system", "content": "You are the scribe of the town hall."},
                         {"role": "user", "content": content}]}
    return inference.plan(identify(headers, body, None), body, request_id, "m").plan


def test_apps_beyond_the_bound_leave_memory_least_recently_used_first():
    inference = Inference(InferenceSettings(max_apps=3))
    for app in ("a", "b", "c", "a", "d"):
        _plan(inference, {"x-kvrelay-app": app, "x-session-id": "s"}, "hello there, scribe")
    assert list(inference.apps) == ["c", "a", "d"] and inference.bounded["apps_evicted"] == 1


def test_sessions_per_app_are_bounded_with_a_count():
    inference = Inference(InferenceSettings(max_sessions=50))
    for i in range(120):
        _plan(inference, {"x-session-id": f"s{i}"}, "hello there, scribe")
    assert len(inference.apps["default"].sessions) == 50
    assert inference.bounded["sessions_evicted"] == 70


def test_a_session_keeps_at_most_so_many_texts():
    inference = Inference(InferenceSettings(max_texts_per_session=16))
    plan = _plan(inference, {"x-session-id": "s"}, "Begin the reports.")
    for i in range(40):
        inference.observe_response("default", plan.session_id, "scribe", f"r{i}",
                                   f"Report number {i}: the granary holds {i * 37} sacks of barley and {i * 11} of rye.")
    session = inference.apps["default"].sessions["s"]
    assert len(session.texts) == 16 and inference.bounded["texts_not_kept"] == 40 - 15  # the question is one
    _plan(inference, {"x-session-id": "s"}, "One more report, still answered.")  # planning goes on


def test_a_plan_of_too_many_segments_is_not_sent():
    inference = Inference(InferenceSettings(max_plan_segments=4, separators=["<TTSEP>"]))
    content = "<TTSEP>".join(f"block {i} of the long survey of the harbour district" for i in range(12))
    plan = _plan(inference, {"x-session-id": "s"}, content)
    assert plan.segments == [] and inference.bounded["plans_cut"] == 1


@pytest.mark.slow
def test_a_hundred_thousand_distinct_sessions_stay_within_the_bound():
    inference = Inference(InferenceSettings(max_sessions=10_000))
    for i in range(100_000):
        body = {"messages": [{"role": "user", "content": f"session {i} asks about the tides"}]}
        inference.plan(identify({"x-kvrelay-session-id": f"s{i}"}, body, None), body, f"r{i}", "m")
    sessions = inference.apps["default"].sessions
    assert len(sessions) == 10_000 and inference.bounded["sessions_evicted"] == 90_000
    assert "s99999" in sessions and "s0" not in sessions  # the least recently used left first
