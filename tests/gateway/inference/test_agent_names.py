"""Agents as the traffic names them, and agents without a system prompt."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.inference.views import session_detail
from kvrelay.gateway.settings import InferenceSettings
from kvrelay.gateway.ttft import session_ttft

TASK = "Plan a three-day trip to Lisbon on a small budget, with one museum a day."
PLAN = "Day one: the castle and Alfama. Day two: Belem and its tower. Day three: the tile museum."
DRAFT = "Lisbon on a budget: walk the old town, ride tram 28 once, and keep the museums for the afternoons."


def _ask(inference: Inference, messages: list[dict[str, Any]], request_id: str, answer: str = ""):
    body = {"model": "m", "messages": messages}
    result = inference.plan(identify({"x-session-id": "s"}, body), body, request_id, "m")
    if answer:
        inference.observe_response("default", "s", result.agent_id, request_id, answer)
    return result


def _system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def test_an_output_quoted_under_a_name_names_its_agent_in_the_admin_view_and_the_graph():
    inference = Inference(InferenceSettings())
    task = {"role": "user", "name": "user", "content": TASK}
    planner = _ask(inference, [_system("You are the planner. Break the task into steps."), task], "r1", PLAN)
    writer = _ask(inference, [_system("You are the writer. Turn the plan into an answer."), task,
                              {"role": "user", "name": "planner", "content": PLAN}], "r2", DRAFT)
    # A name on a message that only holds part of an output says nothing about its agent.
    _ask(inference, [_system("You are the critic. Find the weakest point."), task,
                     {"role": "user", "name": "writer", "content": f"Note: {DRAFT} (first draft)"}], "r3")
    app = inference.apps["default"]
    assert app.agents[planner.agent_id].name == "planner"
    assert app.agents[writer.agent_id].name is None
    detail = session_detail(app, "default", app.sessions["s"])
    assert {a["id"]: a["name"] for a in detail["agents"]}[planner.agent_id] == "planner"
    assert '"planner"' in detail["mermaid"]
    again = _ask(inference, [_system("You are the planner. Break the task into steps."), task], "r4")
    assert again.agent_name == "planner"


def test_agents_without_a_system_prompt_are_told_apart_by_their_instruction_line():
    inference = Inference(InferenceSettings())
    title = _ask(inference, [{"role": "user", "content": f"Give this text a short title:\n\n{DRAFT}"}], "r1")
    title_again = _ask(inference, [{"role": "user", "content": f"Give this text a short title:\n\n{PLAN}"}], "r2")
    pick = _ask(inference, [{"role": "user", "content": f"Pick the next speaker.\nplanner, writer\n\n{PLAN}"}], "r3")
    critic = _ask(inference, [{"role": "user", "content": TASK}, {"role": "user", "content": PLAN}], "r4")
    critic_again = _ask(inference, [{"role": "user", "content": "Suggest a weekly plan for learning Spanish."}], "r5")
    assert title.agent_id == title_again.agent_id
    assert len({title.agent_id, pick.agent_id, critic.agent_id}) == 3
    assert critic.agent_id == critic_again.agent_id  # a one-line first message is the task: one plain assistant


def _row(request_id: str, round_id: str | None) -> SimpleNamespace:
    plan = json.dumps({"round": {"id": round_id, "size": 2, "index": 0}}) if round_id else None
    return SimpleNamespace(id=request_id, agent_id="a", started_at=datetime.now(UTC), status="ok", stream=False,
                           prompt_tokens=None, cached_tokens=None, ttft_ms=None, latency_ms=None,
                           ttft_breakdown=None, plan=plan)


def test_the_ttft_report_shows_only_rounds_that_formed():
    report = session_ttft("s", [_row("a", "s/r1"), _row("b", "s/r1"), _row("c", "s/r2")])
    assert [r["round_id"] for r in report["rounds"]] == ["s/r1"]
    assert [r["round_id"] for r in report["requests"]] == ["s/r1", "s/r1", None]
