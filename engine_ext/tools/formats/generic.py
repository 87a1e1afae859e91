"""Tool calls for any model, in the spirit of llama.cpp's generic format: for a chat
template without a tools branch (SmolLM2's), the tools are described in a system
message and the answer is one JSON object, constrained by a grammar to be either

    {"tool_call": {"name": ..., "arguments": {...}}}      (or "tool_calls": [...], parallel)
    {"response": "the answer to the user"}

With tool_choice "auto" the model picks the key; "required" or a named function leaves
only the call. A model without tool training does not pick well: SmolLM2-135M answered
{"response": ...} to every request a tool was for, and after a tool's result it sometimes
called the same tool again instead of answering. Under the "call-first" policy (the default,
`--generic-tool-auto`), "auto" is therefore decided by the turn: an answer to a user
message calls a tool, and an answer after the turn's tool results is a response. An
agent loop thus makes one round of calls per user message and finishes. "model" leaves
every choice to the model. The system message is the same under either decision, so
the prompt (and its cached prefix) does not change with it. Earlier calls in the chat are written back in the same JSON, so the model
reads its own format; tool results keep the `tool` role and their text as sent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from engine_ext.structured.grammar import Grammar, SchemaDocument, json_rule
from engine_ext.tools.calls import ParsedAnswer
from engine_ext.tools.formats.base import (Choice, Function, Named, Prepared, Reading, TextSchema, ToolFormat,
                                           call_object, lenient)
from engine_ext.tools.stream import AnswerStream, JsonFieldStream, decoded_prefix

RESPONSE_PREFIX = '{"response": "'
AutoPolicy = Literal["call-first", "model"]


class GenericFormat(ToolFormat):
    name = "generic"
    auto_policy: AutoPolicy = "call-first"

    def effective_choice(self, messages: list[dict[str, Any]], choice: Choice) -> Choice:
        if choice != "auto" or self.auto_policy == "model":
            return choice
        turn = [m.get("role") for m in messages if m.get("role") not in ("system", "developer")]
        if turn and turn[-1] == "tool":
            return "respond"
        return "required" if turn and turn[-1] == "user" else "auto"

    @classmethod
    def matches(cls, template: str) -> bool:
        return True

    def prepare(self, messages: list[dict[str, Any]], functions: Sequence[Function], choice: Choice,
                parallel: bool) -> Prepared:
        """The tools' system message goes after the chat's leading system messages, so an
        agent's own system prompt stays the start of its prompt (and its cached prefix)."""
        at = 0
        while at < len(messages) and messages[at].get("role") in ("system", "developer"):
            at += 1
        rewritten = [_with_calls_as_json(m) for m in messages]
        system = {"role": "system", "content": _instructions(functions, choice, parallel)}
        index_map = [i if i < at else i + 1 for i in range(len(messages))]
        return Prepared(rewritten[:at] + [system] + rewritten[at:], None, index_map)

    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        doc = SchemaDocument()
        return f"calls: {json_rule(doc.root(self._calls(functions, parallel, doc)), lenient(functions))}\n"

    def grammar(self, functions: Sequence[Function], choice: Choice, parallel: bool,
                text: TextSchema | None) -> Grammar | None:
        """One JSON Schema: the call object, the response object, or either. Not two
        grammar alternatives: both open with `{"`, which llguidance's lexer must not
        have to split between a literal and a JSON lexeme."""
        if choice == "required" or isinstance(choice, Named):
            return super().grammar(functions, choice, parallel, text)  # only `calls`
        doc = SchemaDocument()
        calls = self._calls(functions, parallel, doc)
        # The response: a string, or the app's JSON (response_format) inside it.
        value = {"type": "string"} if text is None else doc.embed(text.schema)
        response = {"type": "object", "properties": {"response": value}, "required": ["response"]}
        answer = response if choice == "respond" else {"anyOf": [calls, response]}
        strict = (text is None or text.strict) and not lenient(functions)
        return Grammar(f"start: {json_rule(doc.root(answer), not strict)}\n", "tool_choice")

    @staticmethod
    def _calls(functions: Sequence[Function], parallel: bool, doc: SchemaDocument) -> dict[str, Any]:
        call = call_object(functions, doc)
        if parallel:
            key, value = "tool_calls", {"type": "array", "items": call, "minItems": 1}
        else:
            key, value = "tool_call", call
        return {"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": False}

    def parse(self, text: str, reading: Reading) -> ParsedAnswer:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            # Cut by max_tokens (the grammar admits nothing else): a response reads as its
            # decoded part; an unfinished call, or an opening not yet decided, is neither
            # call nor content: this format's JSON is the engine's, never the app's.
            if text.startswith(RESPONSE_PREFIX) and not reading.json_text:
                return ParsedAnswer(decoded_prefix(text[len(RESPONSE_PREFIX):]))
            return ParsedAnswer(None)
        if not isinstance(data, dict):
            return ParsedAnswer(None)
        if "response" in data:
            response = data["response"]
            as_json = reading.json_text or not isinstance(response, str)
            return ParsedAnswer(json.dumps(response, ensure_ascii=False) if as_json else response)
        return self.answer_of_calls(data["tool_calls"] if "tool_calls" in data else [data.get("tool_call")], text,
                                    reading)

    def stream(self, reading: Reading) -> AnswerStream:
        # A JSON text answer goes out whole at the end (its value is re-encoded compactly).
        return JsonFieldStream(self, reading, RESPONSE_PREFIX if not reading.json_text else None)


def _instructions(functions: Sequence[Function], choice: Choice, parallel: bool) -> str:
    tools = [{"name": f.name, **({"description": f.description} if f.description else {}),
              "parameters": f.arguments_schema()} for f in functions]
    call = ('{"tool_calls": [{"name": <tool name>, "arguments": <its arguments>}, ...]}' if parallel
            else '{"tool_call": {"name": <tool name>, "arguments": <its arguments>}}')
    if isinstance(choice, Named):
        how = f"Answer by calling the tool {choice.name}: {call}."
    elif choice == "required":
        how = f"Answer by calling a tool: {call}."
    else:
        how = (f"To call a tool, answer with {call}. To answer directly, answer with "
               '{"response": <your answer to the user>}.')
    return ("You can call these tools (each one's arguments as a JSON Schema):\n"
            f"{json.dumps(tools, ensure_ascii=False)}\n"
            f"Answer with one JSON object. {how}")


def _with_calls_as_json(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls, written as this format's JSON answer."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    items = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    answer = {"tool_call": items[0]} if len(items) == 1 else {"tool_calls": items}
    return {k: v for k, v in message.items() if k != "tool_calls"} | {
        "content": json.dumps(answer, ensure_ascii=False)}
