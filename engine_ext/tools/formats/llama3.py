"""Llama 3.1/3.2/3.3 JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`); several are separated by `; `."""

from __future__ import annotations

import json
from collections.abc import Sequence

from engine_ext.tools.calls import ParsedAnswer, ToolCall, arguments_text
from engine_ext.tools.formats.base import Function, ToolFormat
from engine_ext.tools.stream import AnswerStream, LeadingStream

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"

    @classmethod
    def matches(cls, template: str) -> bool:
        return "<|start_header_id|>" in template and ('"parameters"' in template or PYTHON_TAG in template)

    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"calls: call{more}\ncall: {self.calls_json(functions, 'parameters')}\n"

    def parse(self, text: str) -> ParsedAnswer:
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ParsedAnswer(text)
        calls, at = [], 0
        while at < len(body):
            try:
                data, at = _DECODER.raw_decode(body, at)
            except ValueError:
                return ParsedAnswer(text)
            arguments = arguments_text(data.get("parameters", data.get("arguments"))) if isinstance(data, dict) \
                else None
            if arguments is None or not isinstance(data.get("name"), str):
                return ParsedAnswer(text)
            calls.append(ToolCall(self.new_call_id(), data["name"], arguments))
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return ParsedAnswer(None, tuple(calls))

    def stream(self) -> AnswerStream:
        return LeadingStream(self, (PYTHON_TAG, "{"))
