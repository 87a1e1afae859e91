"""Telling agents apart when the request does not name them.

Real frameworks send no agent id; what distinguishes agents is their system prompt
(and the model or adapter they call). A request belongs to a known agent of its app
and model when its system prompt starts with the agent's learned fixed prefix, or,
while that prefix is still being learned, shares at least `same_agent_ratio` of it
(system prompts often end in a variable tail: a date, a turn counter). Both cases are
one rule: the common prefix of prompt and candidate reaches the agent's threshold
(agenttable.py, which finds such agents without a scan). Otherwise it is a new agent,
named by a hash of its model and system prompt so the name is stable across restarts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from gateway.inference.prefix import PrefixLearner
from gateway.inference.agenttable import AgentState
from gateway.inference.state import AppState


def resolve_agent(app: AppState, explicit_id: str | None, system_text: str | None, model: str,
                  new_learner: Callable[[], PrefixLearner]) -> AgentState:
    """The request's agent, as its app's most recently used."""
    if explicit_id is not None:
        return app.agents.use(explicit_id, model, new_learner)
    if system_text is None:
        return app.agents.use(f"default@{model}", model, new_learner)
    known = app.agents.match(model, system_text)
    if known is not None:
        return app.agents.use(known.id, model, new_learner)
    digest = hashlib.sha256(f"{model}\0{system_text}".encode()).hexdigest()[:10]
    return app.agents.use(f"agent-{digest}", model, new_learner)
