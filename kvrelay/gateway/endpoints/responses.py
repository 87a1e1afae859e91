"""`POST /v1/responses`: the Responses API, read by the gateway as the chat call it stands for.

The gateway's record, limits, rate-limit estimate and structure inference all read
chat bodies (`messages`). A Responses body is translated to one with the engine's own
translation (kvrelay/openai_responses.py), so the plan's message indices match the
messages the engine builds; the body itself goes upstream unchanged, with the plan.
The translation is lenient here: the gateway may front upstreams that support images,
reasoning or built-in tools, so what it cannot read is left out of the view and left
to the upstream to accept or refuse; only a malformed body is a 400 at the gateway.

A stored history (previous_response_id) lives in the engine and is not in the view;
the engine shifts the plan past it. The answer's facts (text, function-call ids, usage)
come from the Response's output items, or from its stream's events (kvrelay/gateway/sse.py).
The id of each relayed Response is remembered with its session (ResponseSessions): a
continuation that names it joins that session.
"""

from __future__ import annotations

from collections import OrderedDict

import json
from typing import Any

from kvrelay.gateway.endpoints.base import AnswerFacts, Endpoint, PromptView
from kvrelay.gateway.errors import BadRequestError
from kvrelay.gateway.limits import check_messages
from kvrelay.gateway.settings import LimitSettings
from kvrelay.gateway.sse import chat_usage, response_call_ids, response_finish_reasons
from kvrelay.wire.errors import error_body
from kvrelay.openai_responses import ResponsesRequestError, parse_request, to_chat

_REPLACED = ("input", "instructions")


def chat_view(body: dict[str, Any]) -> dict[str, Any]:
    """The body as the chat completions request it stands for: its other fields, plus
    `messages` (instructions, then the input) and the chat names of its settings."""
    try:
        chat = to_chat(parse_request(body), strict=False)
    except ResponsesRequestError as exc:
        raise BadRequestError(exc.message, param=exc.param, code=exc.code) from exc
    return {**{k: v for k, v in body.items() if k not in _REPLACED}, **chat}


class Responses(Endpoint):
    path = "/v1/responses"
    operation = "chat"

    def view(self, body: dict[str, Any], limits: LimitSettings) -> PromptView:
        if not isinstance(body.get("input"), (str, list)):
            raise BadRequestError("input: a string or a list of input items is required", param="input")
        view = chat_view(body)
        check_messages(view["messages"], limits)
        return PromptView(view, json.dumps(view["messages"], sort_keys=True, ensure_ascii=False))

    def continues(self, body: dict[str, Any]) -> str | None:
        previous = body.get("previous_response_id")
        return previous if isinstance(previous, str) else None

    def upstream_body(self, body: dict[str, Any], stream: bool) -> tuple[dict[str, Any], bool]:
        return body, False  # a Responses stream always ends with its usage, in the final Response

    def answer(self, parsed: dict[str, Any]) -> AnswerFacts:
        return answer_facts(parsed)

    def stream_error(self, message: str, type_: str, code: str, last_sequence: int) -> bytes:
        return error_event(message, type_, code, last_sequence + 1)


def answer_facts(response: dict[str, Any]) -> AnswerFacts:
    """What a (unary) Response tells the record and structure inference."""
    output = response.get("output")
    items = output if isinstance(output, list) else []
    text = "".join(part["text"] for item in items if isinstance(item, dict) and item.get("type") == "message"
                   for part in _content_parts(item)
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    ident = response.get("id")
    return AnswerFacts(text, response_call_ids(items), chat_usage(response.get("usage")),
                       response_finish_reasons(response), ident if isinstance(ident, str) else None)


def _content_parts(item: dict[str, Any]) -> list[Any] | tuple[()]:
    content = item.get("content")
    return content if isinstance(content, list) else ()


def error_event(message: str, type_: str, code: str, sequence_number: int) -> bytes:
    """The gateway's own mid-stream failure, as a Responses `error` event; its data also
    holds the chat-style `error` object, which the OpenAI SDKs raise as an APIError."""
    body = {"type": "error", "sequence_number": sequence_number, "message": message, "code": code, "param": None,
            **error_body(message, type_, None, code)}
    return f"event: error\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


class ResponseSessions:
    """Which session each relayed response belongs to, for the last `max_entries`.

    A request that continues a response by `previous_response_id` may carry nothing
    else to link it (`input: "go on"`), and the response's history lives in the engine
    that answered it: naming the session keeps the continuation in that session, and
    session affinity sends it to that engine. Keyed by app, so ids never cross tenants."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._sessions: OrderedDict[tuple[str, str], str] = OrderedDict()

    def remember(self, app_id: str, response_id: str, session_id: str) -> None:
        self._sessions[(app_id, response_id)] = session_id
        self._sessions.move_to_end((app_id, response_id))
        while len(self._sessions) > self.max_entries:
            self._sessions.popitem(last=False)

    def session_of(self, app_id: str, response_id: str | None) -> str | None:
        return self._sessions.get((app_id, response_id)) if response_id is not None else None
