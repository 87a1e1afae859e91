"""Who is calling, as far as the request says so explicitly.

Layered, first hit wins. Session: a session header (ours, or one that agent tools
already send), then `prompt_cache_key`, `metadata.session_id`, `user`. Agent: an agent
header, `metadata.agent_id`, then the `name` of the system message. App: the API key,
else an app header, else one default app. Everything inferred from content (sessions
linked through earlier outputs, agents told apart by their system prompts) builds on
this in gateway.inference, always inside one app: two apps that both have a "Planner"
are never merged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvrelay.json_values import encodable

SESSION_HEADERS = (
    "x-kvrelay-session-id", "x-kvrelay-session", "x-session-id",
    "x-claude-code-session-id", "x-dynamo-session-id", "x-litellm-session-id",
)
AGENT_HEADERS = ("x-kvrelay-agent-id", "x-agent-id")
APP_HEADERS = ("x-kvrelay-app", "x-client-id")
DEFAULT_APP = "default"
_MAX_ID_CHARS = 128


class Identity(NamedTuple):
    app_id: str
    session_id: str | None  # None: to be inferred from content
    agent_id: str | None


def identify(headers: Mapping[str, str], body: dict[str, Any], api_key_id: str | None = None) -> Identity:
    raw_metadata = body.get("metadata")
    metadata: dict[str, Any] = raw_metadata if isinstance(raw_metadata, dict) else {}
    session = _first(headers.get(h) for h in SESSION_HEADERS) or _first(
        (body.get("prompt_cache_key"), metadata.get("session_id"), body.get("user")))
    agent = _first(headers.get(h) for h in AGENT_HEADERS) or _first(
        (metadata.get("agent_id"), _system_name(body)))
    app = api_key_id or _first(headers.get(h) for h in APP_HEADERS) or DEFAULT_APP
    return Identity(app, session, agent)


def _system_name(body: dict[str, Any]) -> Any:
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and message.get("role") in ("system", "developer"):
                return message.get("name")
    return None


def _first(values: Any) -> str | None:
    """The first usable id: a non-blank string that is valid Unicode (a lone surrogate,
    which JSON allows, could not be stored, traced or sealed)."""
    for value in values:
        if isinstance(value, str) and value.strip() and encodable(value):
            return value.strip()[:_MAX_ID_CHARS]
    return None

