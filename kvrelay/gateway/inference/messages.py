"""What the planner reads of a request body: its messages, their names, the tool calls they carry."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kvrelay.gateway.sse import tool_call_ids


@dataclass(frozen=True, slots=True)
class PromptMessage:
    index: int
    role: str
    name: str | None
    content: str | None  # None when the content is not a plain string (parts, tool calls only)


def prompt_messages(body: dict[str, Any]) -> list[PromptMessage]:
    messages = body.get("messages")
    if isinstance(messages, list):
        return [PromptMessage(i, str(m.get("role", "")), m.get("name") if isinstance(m.get("name"), str) else None,
                              m.get("content") if isinstance(m.get("content"), str) else None)
                for i, m in enumerate(messages) if isinstance(m, dict)]
    prompt = body.get("prompt")
    return [PromptMessage(0, "user", None, prompt if isinstance(prompt, str) else None)]


def call_ids(body: dict[str, Any]) -> list[str]:
    """The tool-call ids a prompt carries: on the calls of its assistant messages, and on its tool messages."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    answered = [m["tool_call_id"] for m in messages if isinstance(m, dict) and isinstance(m.get("tool_call_id"), str)]
    return [*tool_call_ids(messages), *answered]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
