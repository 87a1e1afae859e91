"""`POST /v1/responses` on the engine: the Responses API over CompletionService's chat.

A Responses request is translated into a chat completions request
(kvrelay/openai_responses.py), validated as the chat route validates its body, run by
CompletionService, and its answer or chunks shaped back (kvrelay/openai_responses_output.py,
kvrelay/openai_responses_stream.py), so both APIs share one generation path.

previous_response_id continues a conversation the engine kept: ResponseStore holds the
last N responses (`store: false` ones are not kept), each as the chat messages it added
(its new input and its answer) linked to the turn it continued, so a long chain is kept
once rather than once per response. The earlier instructions are not carried over (as
on OpenAI). The gateway planned the request without that history, so its plan's later
message indices are shifted past it (engine_ext/server/plans.py MessageShift), after the
seal check.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine_ext.errors import InvalidRequestError
from engine_ext.server.plans import MessageShift
from engine_ext.server.schemas import ChatCompletionRequest
from engine_ext.server.service import CompletionService
from kvrelay.openai_responses import (REQUEST_SCHEMA, ResponsesRequest, ResponsesRequestError, history_offset,
                                      parse_request, to_chat, validation_error)
from kvrelay.openai_responses_output import answer_message, response_from_chat
from kvrelay.openai_responses_stream import ResponsesStream

DEFAULT_MAX_STORED = 1024
RESPONSES_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": REQUEST_SCHEMA}}}}
# Chat fields as the Responses request names them, for errors the chat validation raises.
_PARAM_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"))


@dataclass(frozen=True)
class _Turn:
    parent: _Turn | None
    messages: tuple[dict[str, Any], ...]  # the input it added and its answer, as chat messages
    stored_at: float

    def conversation(self) -> list[dict[str, Any]]:
        turns: list[tuple[dict[str, Any], ...]] = []
        turn: _Turn | None = self
        while turn is not None:
            turns.append(turn.messages)
            turn = turn.parent
        return [message for messages in reversed(turns) for message in messages]


class ResponseStore:
    """The responses a later request may continue: the last `max_entries` stored (least
    recently used out), each for `ttl_s` seconds at most (None: no limit). A turn held by
    a later one stays in memory as part of its chain after it leaves the index, so the
    memory is that of the distinct turns the indexed responses reach."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or (ttl_s is not None and ttl_s <= 0):
            raise ValueError("max_entries must be at least 1 and ttl_s positive")
        self.max_entries, self.ttl_s, self._clock = max_entries, ttl_s, clock
        self._turns: OrderedDict[str, _Turn] = OrderedDict()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ResponseStore:
        """KVRELAY_RESPONSES_MAX_STORED (default 1024) and KVRELAY_RESPONSES_TTL_S (default: none)."""
        env = os.environ if env is None else env
        try:
            ttl = env.get("KVRELAY_RESPONSES_TTL_S")
            return cls(int(env.get("KVRELAY_RESPONSES_MAX_STORED") or DEFAULT_MAX_STORED),
                       float(ttl) if ttl else None)
        except ValueError as exc:
            raise ValueError(f"KVRELAY_RESPONSES_MAX_STORED / KVRELAY_RESPONSES_TTL_S: {exc}") from exc

    def __len__(self) -> int:
        return len(self._turns)

    def get(self, response_id: str) -> _Turn | None:
        turn = self._turns.get(response_id)
        if turn is None:
            return None
        if self.ttl_s is not None and self._clock() - turn.stored_at > self.ttl_s:
            del self._turns[response_id]
            return None
        self._turns.move_to_end(response_id)
        return turn

    def keep(self, response_id: str, parent: _Turn | None, messages: list[dict[str, Any]]) -> None:
        self._turns[response_id] = _Turn(parent, tuple(messages), self._clock())
        self._turns.move_to_end(response_id)
        while len(self._turns) > self.max_entries:
            self._turns.popitem(last=False)


@dataclass(frozen=True)
class PreparedResponse:
    req: ResponsesRequest
    chat: ChatCompletionRequest
    parent: _Turn | None  # the stored turn it continues
    new_messages: list[dict[str, Any]]  # its input as chat messages, kept with its answer
    shift: MessageShift | None  # the plan's messages after the inserted history

    @property
    def stream(self) -> bool:
        return self.req.stream


class ResponsesAPI:
    def __init__(self, service: CompletionService, store: ResponseStore) -> None:
        self.service = service
        self.store = store

    def prepare(self, body: Any) -> PreparedResponse:
        """The validated request and its chat translation; raises InvalidRequestError."""
        try:
            req = parse_request(body)
            parent = None
            if req.previous_response_id is not None:
                parent = self.store.get(req.previous_response_id)
                if parent is None:
                    raise ResponsesRequestError(f"Previous response with id '{req.previous_response_id}' not found.",
                                                "previous_response_id", "previous_response_not_found")
            history = parent.conversation() if parent is not None else []
            translated = to_chat(req, history)
        except ResponsesRequestError as exc:
            raise InvalidRequestError(exc.message, exc.param, exc.code) from exc
        try:
            chat = ChatCompletionRequest.model_validate(translated)
        except ValidationError as exc:
            error = validation_error(exc)
            raise InvalidRequestError(error.message, _responses_param(error.param)) from exc
        offset = history_offset(req.instructions)
        shift = MessageShift(offset, len(history)) if history else None
        return PreparedResponse(req, chat, parent, translated["messages"][offset + len(history):], shift)

    async def complete(self, prepared: PreparedResponse, headers: Mapping[str, str]) -> dict[str, Any]:
        with _responses_params():
            chat = await self.service.complete(prepared.chat, headers, prepared.shift)
        response = response_from_chat(prepared.req, chat)
        self._keep(prepared, response)
        return response

    async def stream(self, prepared: PreparedResponse, headers: Mapping[str, str]) -> AsyncGenerator[str, None]:
        """The event stream; errors before the first chunk raise here, as on chat."""
        with _responses_params():
            lines = await self.service.stream(prepared.chat, headers, prepared.shift)
        return self._events(prepared, lines)

    async def _events(self, prepared: PreparedResponse, lines: AsyncGenerator[str, None]
                      ) -> AsyncGenerator[str, None]:
        translator = ResponsesStream(prepared.req)
        async with contextlib.aclosing(lines):  # closing early aborts the request
            for event in translator.start():
                yield event
            async for line in lines:
                if (chunk := _chunk(line)) is not None:
                    for event in translator.feed(chunk):
                        yield event
        last = translator.finish()
        if translator.response is not None:
            self._keep(prepared, translator.response)  # before the client can ask to continue it
        for event in last:
            yield event

    def _keep(self, prepared: PreparedResponse, response: dict[str, Any]) -> None:
        if prepared.req.store is False or response.get("status") not in ("completed", "incomplete"):
            return
        answer = answer_message(response["output"])
        self.store.keep(response["id"], prepared.parent, [*prepared.new_messages, answer])


def _chunk(line: str) -> dict[str, Any] | None:
    """The JSON of one `data: {...}` SSE line from CompletionService; None for [DONE]."""
    data = "".join(part[5:].lstrip() for part in line.splitlines() if part.startswith("data:"))
    if not data or data == "[DONE]":
        return None
    chunk = json.loads(data)
    return chunk if isinstance(chunk, dict) else None


@contextlib.contextmanager
def _responses_params() -> Iterator[None]:
    """Errors the chat path raises name the field as the Responses request calls it."""
    try:
        yield
    except InvalidRequestError as exc:
        exc.param = _responses_param(exc.param)
        raise


def _responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)
    if param.startswith("messages"):  # its index counts instructions and history: the input as a whole
        return "input"
    for chat_name, name in _PARAM_NAMES:
        if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
            return name + param[len(chat_name):]
    return param
