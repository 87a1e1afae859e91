"""How each completions route shapes its answer: ids, object names, a choice's body.

Chat and text completions share CompletionService's whole generation path; they differ
only in the prompt (built in the service from messages or text) and in how an answer is
enveloped, which lives here, one class per route, picked once per request by
`choices_for`. (The Responses API is a translation over chat: engine_ext/server/responses.py.)
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from engine_ext.server.schemas import ChatCompletionRequest, CompletionRequest
from engine_ext.server.shaping import ChatShape
from engine_ext.tools.calls import ParsedAnswer, ToolCall


class Choices(ABC):
    """One route's answer shape. Contract: `answer` and `delta` fill a choice that already
    holds its index, logprobs and finish_reason; neither touches the engine."""

    id_prefix: ClassVar[str]
    operation: ClassVar[str]  # the GenAI operation name of the request's spans
    object: ClassVar[str]  # of a unary answer
    chunk_object: ClassVar[str]  # of a stream's chunks
    opens_with_role: ClassVar[bool]  # a stream's first chunk is a role-only delta

    def new_id(self) -> str:
        return self.id_prefix + uuid.uuid4().hex

    def envelope(self, request_id: str, model: str, chunk: bool) -> dict[str, Any]:
        # The model the client asked for: the base, or `base:adapter` (validated before generating).
        return {"id": request_id, "object": self.chunk_object if chunk else self.object, "created": int(time.time()),
                "model": model}

    @abstractmethod
    def answer(self, choice: dict[str, Any], content: str, shape: ChatShape | None) -> None:
        """Fill a unary choice with the whole answer."""

    @abstractmethod
    def delta(self, choice: dict[str, Any], text: str | None, role: bool, calls: tuple[ToolCall, ...]) -> None:
        """Fill a stream chunk's choice: new text, the opening role, or the answer's tool calls."""


class ChatChoices(Choices):
    id_prefix, operation = "chatcmpl-", "chat"
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    opens_with_role = True

    def answer(self, choice: dict[str, Any], content: str, shape: ChatShape | None) -> None:
        parsed = shape.parse(content) if shape is not None else ParsedAnswer(content)
        choice["message"] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            choice["message"]["tool_calls"] = [call.to_openai() for call in parsed.calls]
            choice["finish_reason"] = finish_with_calls(choice["finish_reason"])

    def delta(self, choice: dict[str, Any], text: str | None, role: bool, calls: tuple[ToolCall, ...]) -> None:
        choice["delta"] = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        if calls:
            choice["delta"]["tool_calls"] = [{"index": i, **call.to_openai()} for i, call in enumerate(calls)]


class TextChoices(Choices):
    id_prefix, operation = "cmpl-", "text_completion"
    object = chunk_object = "text_completion"
    opens_with_role = False

    def answer(self, choice: dict[str, Any], content: str, shape: ChatShape | None) -> None:
        choice["text"] = content

    def delta(self, choice: dict[str, Any], text: str | None, role: bool, calls: tuple[ToolCall, ...]) -> None:
        choice["text"] = text or ""


def choices_for(req: ChatCompletionRequest | CompletionRequest) -> Choices:
    return ChatChoices() if isinstance(req, ChatCompletionRequest) else TextChoices()


def finish_with_calls(reason: str | None) -> str | None:
    """An answer that ends in tool calls finishes with "tool_calls", unless it was cut short."""
    return "tool_calls" if reason == "stop" else reason
