"""Who is calling: session and agent ids from explicit headers or body fields.

This is the explicit layer only; inferring sessions and agents from unmodified traffic
(no header, no `user`) builds on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

SESSION_HEADER = "x-kvrelay-session-id"
AGENT_HEADER = "x-kvrelay-agent-id"
_MAX_ID_CHARS = 128


class Identity(NamedTuple):
    session_id: str | None
    agent_id: str | None


def identify(headers: Mapping[str, str], body: dict[str, Any]) -> Identity:
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    session = headers.get(SESSION_HEADER) or metadata.get("session_id") or body.get("user")
    agent = headers.get(AGENT_HEADER) or metadata.get("agent_id")
    return Identity(_clean(session), _clean(agent))


def _clean(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip()[:_MAX_ID_CHARS]
