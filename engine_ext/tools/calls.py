"""A tool call read from an answer, and the answer it came in."""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, as OpenAI's API carries it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    calls: tuple[ToolCall, ...] = ()


def call_id(length: int = 24, prefix: str = "call_") -> str:
    """A fresh call id; some templates insist on a shape (Mistral's: 9 alphanumerics, no prefix)."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))


def arguments_text(arguments: Any) -> str | None:
    """The arguments a model wrote, as the JSON object text OpenAI's API carries; None
    when they are not an object (the answer is then not a tool call)."""
    if isinstance(arguments, str):  # some models write the object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    try:  # NaN and Infinity are not JSON: a client's JSON.parse would fail on them
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
