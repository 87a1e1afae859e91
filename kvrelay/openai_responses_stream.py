"""Chat completion chunks in, Responses API stream events out.

The engine streams chat chunks; a Responses client expects the typed events of
`POST /v1/responses` with `stream: true`, each numbered: response.created and
response.in_progress, then per output item output_item.added, its content
(content_part.added, output_text.delta..., output_text.done, content_part.done for a
message; function_call_arguments.delta... and .done for a call), output_item.done; and
last response.completed (or response.incomplete when the token bound stopped it)
carrying the whole Response with its usage. An in-band chat error, or chunks that stop
before a finish reason, end the stream with response.failed. One translator per stream,
fed one parsed chunk at a time. Torch-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay.openai_responses import ResponsesRequest
from kvrelay.openai_responses_output import (Status, envelope, function_call_item, message_item, new_id,
                                             response_usage, sse_event, status_of, text_part)


@dataclass
class _Item:
    index: int  # output_index
    id: str
    kind: str  # "message" or "function_call"
    text: list[str] = field(default_factory=list)  # message text, or call arguments
    call_id: str = ""
    name: str = ""
    status: Status = "in_progress"  # set when it closes

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    def shaped(self, status: Status | None = None) -> dict[str, Any]:
        status = status or self.status
        if self.kind == "message":
            return message_item(self.id, "".join(self.text), status)
        return function_call_item(self.id, self.call_id, self.name, "".join(self.text), status)


class ResponsesStream:
    """Translates one chat stream; `start()` first, `feed(chunk)` per chunk, then `finish()`.
    Each returns the SSE text of the events it makes; `response` is the final Response."""

    def __init__(self, req: ResponsesRequest, response_id: str | None = None, created_at: int | None = None) -> None:
        self.req = req
        self.id = response_id or new_id("resp")
        self.created_at = int(time.time()) if created_at is None else created_at
        self.response: dict[str, Any] | None = None
        self._sequence = 0
        self._items: list[_Item] = []
        self._message: _Item | None = None  # the open message item
        self._calls: dict[int, _Item] = {}  # chat tool-call index -> its item
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.response is not None

    def start(self) -> list[str]:
        snapshot = envelope(self.req, self.id, self.created_at, "in_progress", [])
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        if self.finished:
            return []
        if isinstance(error := chunk.get("error"), dict):
            return self.fail(error)
        events: list[str] = []
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = given if isinstance(given := choice.get("delta"), dict) else {}
            if isinstance(text := delta.get("content"), str) and text:
                events += self._text(text)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    events += self._call(call)
            if isinstance(reason := choice.get("finish_reason"), str):
                self._finish_reason = reason
        if isinstance(usage := chunk.get("usage"), dict):
            self._usage = usage
        if isinstance(params := chunk.get("kv_transfer_params"), dict):
            self._params = params
        return events

    def finish(self) -> list[str]:
        """Close the open items and end with response.completed or response.incomplete
        (response.failed if no finish reason came)."""
        if self.finished:
            return []
        if self._finish_reason is None:
            return self.fail({"message": "the completion stream ended before it finished", "type": "server_error"})
        status = status_of(self._finish_reason)
        events: list[str] = []
        if not self._items:  # neither text nor calls: an empty message, as a unary answer has
            self._message = self._open_message(events)
        for item in self._items:
            events += self._close(item, status)
        self.response = envelope(self.req, self.id, self.created_at, status, [i.shaped() for i in self._items],
                                 response_usage(self._usage))
        if self._params is not None:
            self.response["kv_transfer_params"] = self._params
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response)]

    def fail(self, error: dict[str, Any]) -> list[str]:
        """End with response.failed, carrying the error and what was produced so far."""
        if self.finished:
            return []
        failure = {"code": "invalid_prompt" if error.get("type") == "invalid_request_error" else "server_error",
                   "message": str(error.get("message") or "the completion failed"),
                   "param": error.get("param"), "type": error.get("type")}
        self.response = envelope(self.req, self.id, self.created_at, "failed",
                                 [i.shaped(None if i.done else "incomplete") for i in self._items],
                                 response_usage(self._usage), failure)
        return [self._event("response.failed", response=self.response)]

    # -- items -------------------------------------------------------------------------
    def _text(self, text: str) -> list[str]:
        events: list[str] = []
        if self._message is None:
            self._message = self._open_message(events)
        item = self._message
        item.text.append(text)
        events.append(self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _open_message(self, events: list[str]) -> _Item:
        item = _Item(len(self._items), new_id("msg"), "message")
        self._items.append(item)
        events.append(self._event("response.output_item.added", output_index=item.index,
                                  item=message_item(item.id, None, "in_progress")))
        events.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                  content_index=0, part=text_part("")))
        return item

    def _call(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        index = delta.get("index", 0)
        function = given if isinstance(given := delta.get("function"), dict) else {}
        item = self._calls.get(index)
        if item is None:  # a call's first delta: its id and name
            if self._message is not None:  # the text before the calls ends here
                events += self._close(self._message, "completed")
                self._message = None
            for earlier in self._calls.values():  # as OpenAI does, an item closes before the next opens
                events += self._close(earlier, "completed")
            call_id = given_id if isinstance(given_id := delta.get("id"), str) and given_id else new_id("call")
            item = _Item(len(self._items), new_id("fc"), "function_call", call_id=call_id,
                         name=str(function.get("name") or ""))
            self._items.append(item)
            self._calls[index] = item
            events.append(self._event("response.output_item.added", output_index=item.index,
                                      item=function_call_item(item.id, item.call_id, item.name, "", "in_progress")))
        if isinstance(arguments := function.get("arguments"), str) and arguments and not item.done:
            item.text.append(arguments)
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=item.index, delta=arguments))
        return events

    def _close(self, item: _Item, status: Status) -> list[str]:
        if item.done:
            return []
        item.status = status
        text = "".join(item.text)
        if item.kind == "message":
            events = [self._event("response.output_text.done", item_id=item.id, output_index=item.index,
                                  content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", item_id=item.id, output_index=item.index,
                                  content_index=0, part=text_part(text))]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item.id,
                                  output_index=item.index, arguments=text, name=item.name)]
        return [*events, self._event("response.output_item.done", output_index=item.index, item=item.shaped())]

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(event)
