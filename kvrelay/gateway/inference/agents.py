"""Telling agents apart when the request does not name them.

Real frameworks send no agent id; what distinguishes agents is their system prompt
(and the model or adapter they call). A request belongs to a known agent of its app
and model when its system prompt starts with the agent's learned fixed prefix, or,
while that prefix is still being learned, shares at least `same_agent_ratio` of it
(system prompts often end in a variable tail: a date, a turn counter). Both cases are
one rule: the common prefix of prompt and candidate reaches the agent's threshold
(agenttable.py, which finds such agents without a scan). Otherwise it is a new agent,
named by a hash of its model and system prompt so the name is stable across restarts.

A request without a system prompt (a framework's speaker selector, a node that only
sends a user message) is known by the first line of its first message when that
message has several: such agents keep their instruction there ("Give this text a short
title:", then the text). A first message of one line is the task itself, which changes
from run to run: all such requests of a model are one agent, the app's plain assistant
(a group chat's member without a system prompt reads the task first). The first line
counts up to OPENING_LINE_CHARS.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from kvrelay.gateway.inference.agenttable import AgentState
from kvrelay.gateway.inference.prefix import PrefixLearner
from kvrelay.gateway.inference.state import AppState

OPENING_LINE_CHARS = 256


def resolve_agent(app: AppState, explicit_id: str | None, system_text: str | None, model: str,
                  new_learner: Callable[[], PrefixLearner], opening: str | None = None) -> AgentState:
    """The request's agent, as its app's most recently used. `opening`: the text of the
    first message, for a request without a system prompt."""
    if explicit_id is not None:
        return app.agents.use(explicit_id, model, new_learner)
    if system_text is None:
        lines = (opening or "").strip().split("\n", 1)
        head = lines[0][:OPENING_LINE_CHARS] if len(lines) > 1 else ""
        return app.agents.use(f"agent-{_digest(model, 'opening', head)}", model, new_learner)
    known = app.agents.match(model, system_text)
    if known is not None:
        return app.agents.use(known.id, model, new_learner)
    return app.agents.use(f"agent-{_digest(model, system_text)}", model, new_learner)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]
