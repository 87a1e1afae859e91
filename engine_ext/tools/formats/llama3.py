"""Llama 3.1/3.2/3.3 JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`); several are separated by `; `."""

from __future__ import annotations

import json
from collections.abc import Sequence

from engine_ext.structured.grammar import SchemaDocument, json_rule
from engine_ext.tools.calls import ParsedAnswer
from engine_ext.tools.formats.base import Function, Reading, ToolFormat, call_object, lenient
from engine_ext.tools.stream import AnswerStream, LeadingStream

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"

    @classmethod
    def matches(cls, template: str) -> bool:
        return "<|start_header_id|>" in template and ('"parameters"' in template or PYTHON_TAG in template)

    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        doc = SchemaDocument()
        call = json_rule(doc.root(call_object(functions, doc, "parameters")), lenient(functions))
        more = ' ("; " call)*' if parallel else ""
        return f"calls: call{more}\ncall: {call}\n"

    def parse(self, text: str, reading: Reading) -> ParsedAnswer:
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ParsedAnswer(text)
        calls, at = [], 0
        while at < len(body):
            try:
                data, at = _DECODER.raw_decode(body, at)
            except (ValueError, RecursionError):
                return ParsedAnswer(text)
            key = "parameters" if isinstance(data, dict) and "parameters" in data else "arguments"
            call = self.call_of(data, reading, key)
            if call is None:  # JSON that is not a call of the request's tools: the model's answer
                return ParsedAnswer(text)
            calls.append(call)
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return ParsedAnswer(None, tuple(calls))

    def stream(self, reading: Reading) -> AnswerStream:
        return LeadingStream(self, reading, (PYTHON_TAG, "{"))
