"""Server-sent events as the gateway sees them: split into events, look inside, pass on.

Events are forwarded byte for byte; the gateway only parses the `data:` JSON to find the
first generated content (TTFT) and the usage chunk (which it may strip); the final
chunk is re-encoded only to drop what the client must not see (kvrelay/gateway/engine_params.py).
Chat and text completion chunks, and the typed events of the Responses API (`type`
response.*; its usage and the engine's reports ride in the final Response) alike.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from kvrelay.json_codec import loads

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class EventInfo(NamedTuple):
    has_content: bool  # carries generated text or a tool call (a role-only delta does not)
    text: str  # the generated text it carries
    usage: dict[str, Any] | None
    is_usage_only: bool  # the include_usage chunk: no choices, just usage
    error: dict[str, Any] | None
    finish_reasons: tuple[str, ...]
    kv_transfer_params: dict[str, Any] | None = None  # the engine's reports, on the final chunk
    tool_call_ids: tuple[str, ...] = ()  # ids of the tool calls it opens (structure inference links on them)
    terminal: bool = False  # a Responses stream's last event (completed, incomplete, failed)
    response_id: str | None = None  # a Responses stream's id, on its terminal event
    sequence_number: int | None = None  # a Responses event's number


_NOTHING = EventInfo(False, "", None, False, None, ())


class EventTooLargeError(ValueError):
    """An upstream event grew past the reader's bound without ending."""


class EventReader:
    """Splits a byte stream into SSE events as it arrives.

    Only the new bytes (and the three before them, where a boundary may begin) are
    scanned: an event that arrives in many reads costs time linear in its size, where
    rescanning the whole pending buffer on each read is quadratic. An event longer than
    `max_event_bytes` is refused (EventTooLargeError) rather than held without end."""

    def __init__(self, max_event_bytes: int = 16 * 2**20) -> None:
        self.max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no complete boundary

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events completed by `chunk`, each with its trailing blank line."""
        if not self._buffer and chunk.endswith(b"\n\n") and b"\r" not in chunk:
            # The usual read: whole LF-separated events and nothing pending. Without a CR
            # the only boundary is LF LF, and bytes.split finds the same leftmost,
            # non-overlapping boundaries as the pattern, without copying into the buffer.
            # (A read ending in LF LF LF ends with an unfinished "\n": the general path.)
            parts = chunk.split(b"\n\n")
            if not parts[-1]:
                return [chunk] if len(parts) == 2 else [part + b"\n\n" for part in parts[:-1]]
        self._buffer += chunk
        events, start = [], 0
        for match in _BOUNDARY.finditer(self._buffer, max(self._scanned - 3, 0)):
            events.append(bytes(self._buffer[start : match.end()]))
            start = match.end()
        del self._buffer[:start]
        self._scanned = len(self._buffer)
        if self._scanned > self.max_event_bytes:
            raise EventTooLargeError(f"an event exceeded {self.max_event_bytes} bytes without ending")
        return events

    @property
    def rest(self) -> bytes:
        """The unfinished event so far."""
        return bytes(self._buffer)


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete events (each with its trailing blank line) and the unfinished rest."""
    reader = EventReader(max_event_bytes=len(buffer) + 1)
    events = reader.feed(buffer)
    return events, reader.rest


def is_done(event: bytes) -> bool:
    """The stream's terminal `data: [DONE]` event: after it the client has the whole answer."""
    return event.startswith(b"data:") and event[5:].strip() == b"[DONE]"


def inspect(event: bytes) -> EventInfo:
    """What the gateway needs from one event. Called for every event of every stream, so
    the usual shapes take short paths (one data line; one choice) that give the same
    answer as the general ones."""
    if event.startswith(b"data:") and event.find(b"\n") == len(event) - 2 and b"\r" not in event:
        data = event[5:-2].lstrip()  # one line, "data: ...\n\n"
    else:
        data = b"".join(line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return _NOTHING
    try:
        body = loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit
        return _NOTHING
    if not isinstance(body, dict):
        return _NOTHING
    if isinstance(kind := body.get("type"), str):  # chat and completion chunks have no `type`
        return _responses_event(kind, body)
    listed = body.get("choices")
    if isinstance(listed, list) and len(listed) == 1 and isinstance(listed[0], dict):
        choice = listed[0]
        choices = listed
        has_content = _choice_has_content(choice)
        text = _choice_text(choice)
        reason = choice.get("finish_reason")
        finish_reasons: tuple[str, ...] = (reason,) if isinstance(reason, str) else ()
    else:
        choices = [c for c in listed if isinstance(c, dict)] if isinstance(listed, list) else []
        has_content = any(_choice_has_content(c) for c in choices)
        text = "".join(_choice_text(c) for c in choices)
        finish_reasons = finish_reasons_of(choices)
    usage, error, params = body.get("usage"), body.get("error"), body.get("kv_transfer_params")
    usage = usage if isinstance(usage, dict) else None
    return EventInfo(has_content, text, usage, usage is not None and not choices,
                     error if isinstance(error, dict) else None, finish_reasons,
                     params if isinstance(params, dict) else None,
                     tool_call_ids(c.get("delta") for c in choices) if has_content else ())


def _responses_event(kind: str, body: dict[str, Any]) -> EventInfo:
    """What a Responses API event carries: text deltas, function calls (by call_id), and
    in the final Response the usage and the engine's kv_transfer_params."""
    sequence = body.get("sequence_number")
    sequence = sequence if isinstance(sequence, int) and not isinstance(sequence, bool) else None
    if kind == "response.output_text.delta":
        delta = body.get("delta")
        return EventInfo(True, delta if isinstance(delta, str) else "", None, False, None, (), sequence_number=sequence)
    if kind == "response.function_call_arguments.delta":
        return EventInfo(True, "", None, False, None, (), sequence_number=sequence)
    if kind in ("response.output_item.added", "response.output_item.done"):
        calls = response_call_ids([body.get("item")])
        return EventInfo(bool(calls) and kind.endswith("added"), "", None, False, None, (), tool_call_ids=calls,
                         sequence_number=sequence)
    if kind in ("response.completed", "response.incomplete", "response.failed"):
        raw_response = body.get("response")
        response: dict[str, Any] = raw_response if isinstance(raw_response, dict) else {}
        error, params = response.get("error"), response.get("kv_transfer_params")
        failed = kind == "response.failed"
        return EventInfo(False, "", chat_usage(response.get("usage")), False,
                         (error if isinstance(error, dict) else {"message": "the response failed"}) if failed else None,
                         () if failed else response_finish_reasons(response),
                         params if isinstance(params, dict) else None, terminal=True, sequence_number=sequence,
                         response_id=response.get("id") if isinstance(response.get("id"), str) else None)
    if kind == "error":
        return EventInfo(False, "", None, False, {k: body.get(k) for k in ("message", "code", "param")}, (),
                         sequence_number=sequence)
    return _NOTHING._replace(sequence_number=sequence)


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses usage ({input_tokens, output_tokens, input_tokens_details}) in chat's terms."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
            "prompt_tokens_details": {"cached_tokens": cached}}


def response_finish_reasons(response: dict[str, Any]) -> tuple[str, ...]:
    """A Response's status as chat's finish reason: length when its token bound stopped it."""
    status = response.get("status")
    if status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return ("length",) if reason == "max_output_tokens" else (str(reason or "incomplete"),)
    if status == "completed":
        output = response.get("output")
        calls = response_call_ids(output if isinstance(output, list) else [])
        return ("tool_calls",) if calls else ("stop",)
    return ()


def response_call_ids(items: list[Any]) -> tuple[str, ...]:
    """The call_ids of the function_call items among Responses output items."""
    return tuple(item["call_id"] for item in items if isinstance(item, dict) and item.get("type") == "function_call"
                 and isinstance(item.get("call_id"), str) and item["call_id"])


def finish_reasons_of(choices: list[Any]) -> tuple[str, ...]:
    """The finish_reason of each choice that has one (the last chunk of a stream, or a unary body)."""
    return tuple(r for c in choices if isinstance(c, dict) and isinstance(r := c.get("finish_reason"), str))


def _choice_has_content(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))
    return bool(choice.get("text"))


def _choice_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def tool_call_ids(messages: Any) -> tuple[str, ...]:
    """The ids of the tool calls in messages or deltas (`tool_calls[].id`), as sent."""
    ids: list[str] = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict) and isinstance(call_id := call.get("id"), str) and call_id:
                ids.append(call_id)
    return tuple(ids)
