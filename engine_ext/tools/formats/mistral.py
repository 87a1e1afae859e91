"""Mistral calls (v3 tokenizers: Mistral 7B v0.3, Mixtral, Nemo):
`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, the whole answer.

`[TOOL_CALLS]` is a special token, which the detokenizer drops from the text like every
special token; the list after it is what marks the answer as calls."""

from __future__ import annotations

import json
from collections.abc import Sequence

from engine_ext.structured.grammar import json_rule
from engine_ext.tools.calls import ParsedAnswer, call_id
from engine_ext.tools.formats.base import Function, ToolFormat
from engine_ext.tools.stream import AnswerStream, LeadingStream

MARKER = "[TOOL_CALLS]"


class MistralFormat(ToolFormat):
    name = "mistral"

    @classmethod
    def matches(cls, template: str) -> bool:
        return MARKER in template

    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        schemas = [self.call_schema(f) for f in functions]
        item = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        array = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                 "x-guidance": {"lenient": not all(f.strict for f in functions)}}
        return f"calls: {self.marker(MARKER)} {json_rule(array)}\n"

    def parse(self, text: str) -> ParsedAnswer:
        body = text.strip().removeprefix(MARKER).lstrip()
        if not body.startswith("["):
            return ParsedAnswer(text)
        try:
            items = json.loads(body)
        except ValueError:
            return ParsedAnswer(text)
        return self.answer_of_calls(items, text)

    def new_call_id(self) -> str:
        return call_id(9, prefix="")  # Mistral's templates refuse any other id shape

    def stream(self) -> AnswerStream:
        return LeadingStream(self, (MARKER, "["))
