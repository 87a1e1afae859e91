"""What differs between the OpenAI routes the gateway fronts, behind one interface.

A call through the gateway is the same path for every route (kvrelay/gateway/call.py):
read the body, identify, plan, dispatch, relay, record. What a route changes is how its
body reads (the prompt planning sees, the text the record hashes), how its answer reads
(text, tool-call ids, usage, finish reasons), and how the gateway's own mid-stream
error is spelled. Each route is an `Endpoint`; the call never asks which one it has.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

from kvrelay.gateway.settings import LimitSettings
from kvrelay.wire.errors import error_body


class PromptView(NamedTuple):
    body: dict[str, Any]  # the body as planning and identity read it: chat-shaped, or a completions body
    text: str  # the prompt as the record hashes (and, with store_content, keeps) it


class AnswerFacts(NamedTuple):
    """What a unary answer tells the record and structure inference."""
    text: str
    call_ids: tuple[str, ...]  # of the tool calls it makes: later prompts that carry them continue its session
    usage: dict[str, Any] | None  # in chat's terms
    finish_reasons: tuple[str, ...]
    response_id: str | None = None  # a Responses answer's id: continuations join its session


class Endpoint(ABC):
    """One OpenAI route as the gateway reads it.

    Contract: `view` checks the body's route-specific fields (a BadRequestError naming
    the param otherwise) and never changes the body that goes upstream; `answer` and
    `stream_error` never raise on what an upstream sends."""

    path: ClassVar[str]
    operation: ClassVar[str]  # the GenAI operation name the call's span carries

    @abstractmethod
    def view(self, body: dict[str, Any], limits: LimitSettings) -> PromptView:
        """The prompt of a body whose common fields (model, stream) are already checked."""

    def continues(self, body: dict[str, Any]) -> str | None:
        """The id of an earlier answer the body continues, which may be all that links it
        to its session (none by default)."""
        return None

    def upstream_body(self, body: dict[str, Any], stream: bool) -> tuple[dict[str, Any], bool]:
        """The body to send, and whether the usage-only chunk is the gateway's to strip:
        a stream's usage is always asked for (the record needs it) and, when the client
        did not ask, taken out again on the way back."""
        if not stream:
            return body, False
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        if options.get("include_usage"):
            return body, False
        return {**body, "stream_options": {**options, "include_usage": True}}, True

    @abstractmethod
    def answer(self, parsed: dict[str, Any]) -> AnswerFacts:
        """The facts of a unary answer's JSON object."""

    def stream_error(self, message: str, type_: str, code: str, last_sequence: int) -> bytes:
        """The gateway's own in-band error, after a 200 was sent: an `error` chunk, which
        the OpenAI SDKs raise as an APIError. `last_sequence`: of the events relayed (-1: none)."""
        return f"data: {json.dumps(error_body(message, type_, None, code))}\n\n".encode()
