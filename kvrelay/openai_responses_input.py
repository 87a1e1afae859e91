"""Responses API input items, as chat messages.

`input` is a string (one user message) or a list of items: messages (roles user,
system, developer, assistant; content a string or text parts), function_call items (a
turn's calls: consecutive ones join the assistant message right before them) and
function_call_output items (tool messages). Text parts are joined as the engine joins
chat text parts, so a message's content is one string the gateway can plan segments in.
Images, files, audio and every other item type are refused naming the item or part
(`input[2].content[0]`), or left out when translating leniently (the gateway's view).
Split from kvrelay/openai_responses.py; torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = frozenset({"user", "system", "developer", "assistant"})


class ResponsesRequestError(ValueError):
    """A Responses request the translation refuses; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def history_offset(instructions: str | None) -> int:
    """Where stored history goes in the chat messages: after the instructions' message."""
    return 1 if instructions else 0


def chat_messages(input_: str | list[Any], instructions: str | None = None, strict: bool = True,
                  history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Chat messages: the instructions (a system message), `history`, then the input."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    messages.extend(history)
    if isinstance(input_, str):
        messages.append({"role": "user", "content": input_})
        return messages
    translated: list[dict[str, Any]] = []
    for i, item in enumerate(input_):
        if not isinstance(item, dict):
            raise ResponsesRequestError(f"input[{i}]: an input item must be an object", f"input[{i}]")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            if (message := _message(item, i, strict)) is not None:
                translated.append(message)
        elif kind == "function_call":
            call = _function_call(item, i)
            last = translated[-1] if translated else None
            if last is not None and last["role"] == "assistant":  # the same turn's text or calls
                last.setdefault("tool_calls", []).append(call)
            else:
                translated.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            translated.append(_function_output(item, i, strict))
        elif strict:
            raise ResponsesRequestError(f"input[{i}]: input items of type {kind!r} are not supported "
                                        "(message, function_call and function_call_output are)", f"input[{i}].type")
    return messages + translated


def _message(item: dict[str, Any], i: int, strict: bool) -> dict[str, Any] | None:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise ResponsesRequestError(f"input[{i}].role: must be one of user, system, developer, assistant",
                                    f"input[{i}].role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise ResponsesRequestError(f"input[{i}].content: a string or a list of content parts is required",
                                    f"input[{i}].content")
    return {"role": role, "content": _parts_text(content, f"input[{i}].content", strict)}


def _parts_text(parts: list[Any], where: str, strict: bool) -> str:
    """The text of content parts, joined as the engine joins chat text parts."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None
        if kind in _TEXT_PARTS or kind == "refusal":
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise ResponsesRequestError(f"{where}[{j}]: the {kind} part's text must be a string",
                                            f"{where}[{j}]")
            texts.append(text)
        elif kind in _MEDIA_PARTS:
            if strict:
                raise ResponsesRequestError(f"{where}[{j}]: {kind} parts are not supported (text only)",
                                            f"{where}[{j}]")
        elif strict or not isinstance(part, dict):
            raise ResponsesRequestError(f"{where}[{j}]: unsupported content part {kind!r}", f"{where}[{j}]")
    return "".join(texts)


def _function_call(item: dict[str, Any], i: int) -> dict[str, Any]:
    for field in ("call_id", "name", "arguments"):
        value = item.get(field)
        if not isinstance(value, str) or (not value and field != "arguments"):
            raise ResponsesRequestError(f"input[{i}].{field}: a {'' if field == 'arguments' else 'non-empty '}"
                                        "string is required", f"input[{i}].{field}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _function_output(item: dict[str, Any], i: int, strict: bool) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise ResponsesRequestError(f"input[{i}].call_id: a non-empty string is required", f"input[{i}].call_id")
    if isinstance(output, list):
        output = _parts_text(output, f"input[{i}].output", strict)
    elif not isinstance(output, str):
        raise ResponsesRequestError(f"input[{i}].output: a string or a list of content parts is required",
                                    f"input[{i}].output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}
