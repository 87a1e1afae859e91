"""`POST /v1/chat/completions` and `POST /v1/completions`: the routes planning reads as they are."""

from __future__ import annotations

import json
from typing import Any

from kvrelay.gateway.endpoints.base import AnswerFacts, Endpoint, PromptView
from kvrelay.gateway.errors import BadRequestError
from kvrelay.gateway.limits import check_messages, check_prompt
from kvrelay.gateway.settings import LimitSettings
from kvrelay.gateway.sse import finish_reasons_of, tool_call_ids


_PROMPT_JSON = json.JSONEncoder(sort_keys=True, ensure_ascii=False)  # json.dumps(...) builds one per call

class ChatCompletions(Endpoint):
    path = "/v1/chat/completions"
    operation = "chat"

    def view(self, body: dict[str, Any], limits: LimitSettings) -> PromptView:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequestError("messages: a non-empty list of message objects is required", param="messages")
        check_messages(messages, limits)
        return PromptView(body, _PROMPT_JSON.encode(messages))

    def answer(self, parsed: dict[str, Any]) -> AnswerFacts:
        return _choices_answer(parsed)


class Completions(Endpoint):
    path = "/v1/completions"
    operation = "text_completion"

    def view(self, body: dict[str, Any], limits: LimitSettings) -> PromptView:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or not prompt:
            raise BadRequestError("prompt: a non-empty string or list is required", param="prompt")
        check_prompt(prompt, limits)
        return PromptView(body, prompt if isinstance(prompt, str) else json.dumps(prompt))

    def answer(self, parsed: dict[str, Any]) -> AnswerFacts:
        return _choices_answer(parsed)


def _choices_answer(parsed: dict[str, Any]) -> AnswerFacts:
    """A chat or text completion: each choice's message content (or text) and tool calls."""
    raw_choices = parsed.get("choices")
    choices: list[Any] = raw_choices if isinstance(raw_choices, list) else []
    texts: list[str] = []
    call_ids: tuple[str, ...] = ()
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message") or {}
        text = message.get("content") if isinstance(message, dict) else None
        text = text if isinstance(text, str) else choice.get("text")
        texts.append(text if isinstance(text, str) else "")
        call_ids += tool_call_ids([message])
    usage = parsed.get("usage")
    return AnswerFacts("".join(texts), call_ids, usage if isinstance(usage, dict) else None,
                       finish_reasons_of(choices))
