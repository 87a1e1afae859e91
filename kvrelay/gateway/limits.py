"""Bounds on what one request may ask of the gateway, checked before any work.

The body's size is bounded while it is read (`max_body_bytes`, 413); the number of
messages and the characters of each message here (400, naming the field), so a single
request can neither hold megabytes of one message in the inference indexes nor make
the gateway walk thousands of tiny messages.
"""

from __future__ import annotations

from typing import Any

from kvrelay.gateway.errors import BadRequestError
from kvrelay.gateway.settings import LimitSettings


def message_chars(message: dict[str, Any]) -> int:
    """Characters of a message's content: a string, or the text of its parts."""
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part["text"]) for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


def check_messages(messages: list[dict[str, Any]], limits: LimitSettings) -> None:
    if len(messages) > limits.max_messages:
        raise BadRequestError(f"messages: {len(messages)} messages exceed the limit of {limits.max_messages}",
                              param="messages", code="too_many_messages")
    for i, message in enumerate(messages):
        if (n := message_chars(message)) > limits.max_message_chars:
            raise BadRequestError(f"messages[{i}].content: {n} characters exceed the limit of "
                                  f"{limits.max_message_chars}", param=f"messages[{i}].content",
                                  code="message_too_long")


def check_prompt(prompt: str | list[Any], limits: LimitSettings) -> None:
    """A completions prompt counts as one message (a list of prompts as that many)."""
    texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
    if len(texts) > limits.max_messages:
        raise BadRequestError(f"prompt: {len(texts)} prompts exceed the limit of {limits.max_messages}",
                              param="prompt", code="too_many_messages")
    for text in texts:
        if len(text) > limits.max_message_chars:
            raise BadRequestError(f"prompt: {len(text)} characters exceed the limit of {limits.max_message_chars}",
                                  param="prompt", code="message_too_long")
