"""Hermes-style calls, which Qwen2, Qwen2.5, Qwen3 and Hermes 2/3 write:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call,
possibly after some text."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from engine_ext.structured.grammar import SchemaDocument, json_rule
from engine_ext.tools.calls import ParsedAnswer
from engine_ext.tools.formats.base import Function, Reading, ToolFormat, call_object, lenient
from engine_ext.tools.stream import AnswerStream, MarkerStream

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)


class HermesFormat(ToolFormat):
    name = "hermes"

    @classmethod
    def matches(cls, template: str) -> bool:
        return OPEN in template

    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        doc = SchemaDocument()
        call = json_rule(doc.root(call_object(functions, doc)), lenient(functions))
        more = ' ("\\n" call)*' if parallel else ""
        return f'calls: call{more}\ncall: {self.marker(OPEN)} "\\n" {call} "\\n" {self.marker(CLOSE)}\n'

    def parse(self, text: str, reading: Reading) -> ParsedAnswer:
        start = text.find(OPEN)
        if start < 0:
            return ParsedAnswer(text)
        calls = []
        for block, close in _BLOCK.findall(text, start):
            try:
                call = self.call_of(json.loads(block), reading)
            except (ValueError, RecursionError):
                call = None
            if call is None:
                if not close:
                    break  # the last block, cut by max_tokens: no call, and not the app's text
                return ParsedAnswer(text)  # not a well-formed call: the model's text, as written
            calls.append(call)
        content = text[:start]
        return ParsedAnswer(content if content.strip() else None, tuple(calls))

    def stream(self, reading: Reading) -> AnswerStream:
        return MarkerStream(self, reading, OPEN)
