"""A chat completion, shaped as an OpenAI Responses `Response` object.

The other half of kvrelay/openai_responses.py: the engine answers in chat completions,
the client reads a Response (`openai.types.responses.Response` parses it). Output items
follow the answer: a message item with the text (also when there is neither text nor a
call, so that `output` is never empty), then one function_call item per tool call; a
completion stopped by its token bound is `incomplete` with reason max_output_tokens.
The request's settings are echoed as the SDK's Response model expects them. Also the
reverse, for a conversation that continues with previous_response_id: the answer's items
as the chat assistant message they came from. Torch-free.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from kvrelay.openai_responses import ResponsesRequest

Status = Literal["in_progress", "completed", "incomplete", "failed"]


def new_id(prefix: str) -> str:
    """`resp_<hex>`, `msg_<hex>`, `fc_<hex>`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> Status:
    return "incomplete" if finish_reason == "length" else "completed"


def response_usage(usage: Any) -> dict[str, Any] | None:
    """Chat usage ({prompt_tokens, completion_tokens, prompt_tokens_details}) in the Responses shape."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": int(cached or 0), "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def echo_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's function tools, as a Response lists them."""
    tools = []
    for tool in req.tools or ():
        if isinstance(tool, dict) and tool.get("type") == "function":
            tools.append({"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                          "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    return tools


def envelope(req: ResponsesRequest, response_id: str, created_at: int, status: Status,
             output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Response object: the request's settings echoed around `output`."""
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
    text.setdefault("format", {"type": "text"})
    reasoning = req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None
    body: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "model": req.model, "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id, "reasoning": reasoning,
        "service_tier": "default", "store": True if req.store is None else req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature, "text": text,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": echo_tools(req),
        "top_logprobs": req.top_logprobs or 0, "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
        "metadata": req.metadata or {}, "prompt_cache_key": req.prompt_cache_key,
        "safety_identifier": req.safety_identifier,
    }
    if status == "completed":
        body["completed_at"] = int(time.time())
    return body


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: Status) -> dict[str, Any]:
    """A message item; None text: one just opened, with no content part yet."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: Status) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """The output items of a chat answer's message."""
    status = status_of(finish_reason)
    calls = [c for c in message.get("tool_calls") or () if isinstance(c, dict)]
    text = message.get("content")
    items = []
    if text or not calls:
        items.append(message_item(new_id("msg"), text if isinstance(text, str) else "", status))
    for call in calls:
        function = call.get("function") or {}
        items.append(function_call_item(new_id("fc"), str(call.get("id") or new_id("call")),
                                        str(function.get("name") or ""), str(function.get("arguments") or ""),
                                        status))
    return items


def response_from_chat(req: ResponsesRequest, chat: dict[str, Any], response_id: str | None = None) -> dict[str, Any]:
    """The Response for a chat completion body (non-streaming)."""
    choices = chat.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = given if isinstance(given := choice.get("message"), dict) else {}
    finish_reason = choice.get("finish_reason")
    body = envelope(req, response_id or new_id("resp"), int(chat.get("created") or time.time()),
                    status_of(finish_reason), output_items(message, finish_reason), response_usage(chat.get("usage")))
    if isinstance(params := chat.get("kv_transfer_params"), dict):
        body["kv_transfer_params"] = params
    return body


def answer_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat assistant message a Response's output items stand for: its text and calls."""
    text = "".join(part.get("text", "") for item in output if item.get("type") == "message"
                   for part in item.get("content", ()) if part.get("type") == "output_text")
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item.get("type") == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def sse_event(event: dict[str, Any]) -> str:
    """One server-sent event, named by its type as the Responses API streams them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
