"""Telling agents apart when the request does not name them.

Real frameworks send no agent id; what distinguishes agents is their system prompt
(and the model or adapter they call). A request belongs to a known agent of its app
and model when its system prompt starts with the agent's learned fixed prefix, or,
while that prefix is still being learned, shares at least `same_agent_ratio` of it
(system prompts often end in a variable tail: a date, a turn counter). Otherwise it
is a new agent, named by a hash of its model and system prompt so the name is stable
across restarts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from gateway.inference.prefix import PrefixLearner
from gateway.inference.state import AgentState, AppState


def resolve_agent(app: AppState, explicit_id: str | None, system_text: str | None, model: str,
                  new_learner: Callable[[], PrefixLearner], same_agent_ratio: float = 0.9) -> AgentState:
    if explicit_id is not None:
        return _get_or_create(app, explicit_id, model, new_learner)
    if system_text is None:
        return _get_or_create(app, f"default@{model}", model, new_learner)
    best, best_chars = None, 0
    for agent in app.agents.values():
        if agent.model != model or agent.prefix.candidate is None:
            continue
        fixed = agent.prefix.fixed
        if fixed is not None and system_text.startswith(fixed):
            chars = len(fixed)
        else:
            chars = agent.prefix.common_chars(system_text)
            if chars < same_agent_ratio * len(agent.prefix.candidate) or chars < agent.prefix.min_chars:
                continue
        if chars > best_chars:
            best, best_chars = agent, chars
    if best is not None:
        return best
    digest = hashlib.sha256(f"{model}\0{system_text}".encode()).hexdigest()[:10]
    return _get_or_create(app, f"agent-{digest}", model, new_learner)


def _get_or_create(app: AppState, agent_id: str, model: str, new_learner: Callable[[], PrefixLearner]) -> AgentState:
    agent = app.agents.get(agent_id)
    if agent is None:
        agent = app.agents[agent_id] = AgentState(agent_id, model, new_learner())
    return agent
