"""Mistral calls (v3 tokenizers: Mistral 7B v0.3, Mixtral, Nemo):
`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, the whole answer.

`[TOOL_CALLS]` is a special token, which the detokenizer drops from the text like every
special token; a list of calls of the request's tools after it is what marks the answer
as calls (any other JSON list is the model's text)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from engine_ext.structured.grammar import SchemaDocument, json_rule
from engine_ext.tools.calls import ParsedAnswer, call_id
from engine_ext.tools.formats.base import Function, Reading, ToolFormat, call_object, lenient
from engine_ext.tools.stream import AnswerStream, LeadingStream

MARKER = "[TOOL_CALLS]"


class MistralFormat(ToolFormat):
    name = "mistral"

    @classmethod
    def matches(cls, template: str) -> bool:
        return MARKER in template

    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        doc = SchemaDocument()
        array = {"type": "array", "items": call_object(functions, doc), "minItems": 1,
                 **({} if parallel else {"maxItems": 1})}
        return f"calls: {self.marker(MARKER)} {json_rule(doc.root(array), lenient(functions))}\n"

    def parse(self, text: str, reading: Reading) -> ParsedAnswer:
        body = text.strip().removeprefix(MARKER).lstrip()
        if not body.startswith("["):
            return ParsedAnswer(text)
        try:
            items = json.loads(body)
        except (ValueError, RecursionError):
            return ParsedAnswer(text)
        return self.answer_of_calls(items, text, reading)

    def new_call_id(self) -> str:
        return call_id(9, prefix="")  # Mistral's templates refuse any other id shape

    def stream(self, reading: Reading) -> AnswerStream:
        return LeadingStream(self, reading, (MARKER, "["))
