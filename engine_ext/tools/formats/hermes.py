"""Hermes-style calls, which Qwen2, Qwen2.5, Qwen3 and Hermes 2/3 write:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call,
possibly after some text."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from engine_ext.tools.calls import ParsedAnswer, ToolCall, arguments_text
from engine_ext.tools.formats.base import Function, ToolFormat
from engine_ext.tools.stream import AnswerStream, MarkerStream

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesFormat(ToolFormat):
    name = "hermes"

    @classmethod
    def matches(cls, template: str) -> bool:
        return OPEN in template

    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return (f"calls: call{more}\n"
                f'call: {self.marker(OPEN)} "\\n" {self.calls_json(functions)} "\\n" {self.marker(CLOSE)}\n')

    def parse(self, text: str) -> ParsedAnswer:
        start = text.find(OPEN)
        if start < 0:
            return ParsedAnswer(text)
        calls = []
        for block in _BLOCK.findall(text, start):
            call = self._call(block)
            if call is None:
                return ParsedAnswer(text)  # not a well-formed call: the model's text, as written
            calls.append(call)
        content = text[:start]
        return ParsedAnswer(content if content.strip() else None, tuple(calls))

    def _call(self, block: str) -> ToolCall | None:
        try:
            data = json.loads(block)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = arguments_text(data.get("arguments"))
        return None if arguments is None else ToolCall(self.new_call_id(), data["name"], arguments)

    def stream(self) -> AnswerStream:
        return MarkerStream(self, OPEN)
