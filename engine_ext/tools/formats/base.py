"""What a tool-call format is: how tools reach the prompt, the grammar of a call, how
calls are read back.

A format serves one chat-template family. Native formats (Hermes/Qwen, Llama 3 JSON,
Mistral) pass the tools to the model's own template, which renders them the way the
model was trained on, and read calls in the model's own syntax. The generic format is
the fallback for templates without a tools branch.

`tool_choice` "required" or a named function is enforced with a grammar over the
format's own call syntax, so the model writes its usual call and cannot write anything
else; "auto" leaves the model free (natively) and parses what it wrote.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from engine_ext.structured.grammar import Grammar, SchemaDocument, json_rule
from engine_ext.tools.calls import ParsedAnswer, ToolCall, arguments_text, call_id

if TYPE_CHECKING:
    from engine_ext.tokenizer import Tokenizer
    from engine_ext.tools.stream import AnswerStream

@dataclass(frozen=True)
class Named:
    """tool_choice naming one function (a type of its own: "auto" is a valid function name)."""

    name: str


# What the answer may be: "respond" (an answer, no call) is a format's own decision
# (GenericFormat.effective_choice), never a request's.
Choice = Literal["auto", "required", "respond"] | Named


@dataclass(frozen=True)
class TextSchema:
    """The JSON a text answer must be (response_format); strict: every keyword enforced."""

    schema: dict[str, Any]
    strict: bool


@dataclass(frozen=True)
class Reading:
    """What reading an answer back needs from its request."""

    names: frozenset[str]  # the request's tools: an object naming any other is not a call
    json_text: bool = False  # the text answer is JSON (response_format): content is JSON text


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool = False

    def to_template(self) -> dict[str, Any]:
        """The tool as HF chat templates take it (OpenAI's chat form)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.arguments_schema()}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters else {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Prepared:
    """The chat as the template renders it, the tools it is given, and where each of the
    request's messages went (a plan's segments index the request's messages)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    index_map: list[int]


class ToolFormat(ABC):
    """One family's tool-call syntax. Subclasses are registered in formats/__init__.py."""

    name: ClassVar[str]

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    @abstractmethod
    def matches(cls, template: str) -> bool:
        """Whether a chat template (its Jinja source) renders tools this way."""

    @abstractmethod
    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        """Lark rules defining `calls`: one call (or several, when parallel) of the given functions."""

    @abstractmethod
    def parse(self, text: str, reading: Reading) -> ParsedAnswer:
        """The answer's content and calls; text that is not a well-formed call of one
        of the request's tools is content."""

    @abstractmethod
    def stream(self, reading: Reading) -> AnswerStream:
        """A reader of the answer as it is generated (engine_ext/tools/stream.py)."""

    def effective_choice(self, messages: list[dict[str, Any]], choice: Choice) -> Choice:
        """The choice this answer is made under: the request's, for a model that decides itself."""
        return choice

    def prepare(self, messages: list[dict[str, Any]], functions: Sequence[Function], choice: Choice,
                parallel: bool) -> Prepared:
        """Native formats hand the tools to the template as they are."""
        return Prepared(messages, [f.to_template() for f in functions], list(range(len(messages))))

    def grammar(self, functions: Sequence[Function], choice: Choice, parallel: bool,
                text: TextSchema | None) -> Grammar | None:
        """The answer's grammar: only calls when one is required (of the named function,
        if named); calls or JSON valid against `text` when the app asked for both
        (response_format); none when the model is free."""
        calls = self.call_rule(chosen(functions, choice), parallel)
        if choice == "required" or isinstance(choice, Named):
            return Grammar(f"start: calls\n{calls}", "tool_choice")
        if text is not None:
            return Grammar(f"start: {json_rule(text.schema, not text.strict)} | calls\n{calls}", "response_format")
        return None

    def new_call_id(self) -> str:
        return call_id()

    # -- helpers for subclasses -----------------------------------------------------------
    def answer_of_calls(self, items: Any, text: str, reading: Reading) -> ParsedAnswer:
        """A non-empty list of {"name", "arguments"} objects as the answer's calls; the
        text as content if any item is not a call of one of the request's tools."""
        calls = []
        for item in items if isinstance(items, list) and items else [None]:
            call = self.call_of(item, reading)
            if call is None:
                return ParsedAnswer(text)
            calls.append(call)
        return ParsedAnswer(None, tuple(calls))

    def call_of(self, item: Any, reading: Reading, arguments_key: str = "arguments") -> ToolCall | None:
        """A call, if `item` is {"name": <one of the tools>, <arguments_key>: {...}}."""
        if not isinstance(item, dict) or item.get("name") not in reading.names or arguments_key not in item:
            return None
        arguments = arguments_text(item[arguments_key])
        return None if arguments is None else ToolCall(self.new_call_id(), item["name"], arguments)

    def marker(self, text: str) -> str:
        """The Lark term for a marker: its token when the vocabulary has it as one token
        (a model emits `<tool_call>` as one token, never spelled out), else the text."""
        token = self.tokenizer.token_id(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)


def chosen(functions: Sequence[Function], choice: Choice) -> list[Function]:
    """The functions an answer may call."""
    return [f for f in functions if f.name == choice.name] if isinstance(choice, Named) else list(functions)


def call_object(functions: Sequence[Function], doc: SchemaDocument, arguments_key: str = "arguments") -> dict[str, Any]:
    """A JSON Schema of one call object, {"name": ..., <arguments_key>: {...}} (name
    first), of any of `functions`; their parameter schemas are embedded in `doc`."""
    schemas = [{"type": "object",
                "properties": {"name": {"const": f.name}, arguments_key: doc.embed(f.arguments_schema())},
                "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def lenient(functions: Sequence[Function]) -> bool:
    """Unless every function is strict, keywords the grammar cannot enforce are ignored."""
    return not all(f.strict for f in functions)


def pick_format(tokenizer: Tokenizer, formats: Sequence[type[ToolFormat]]) -> ToolFormat:
    """The first format whose template marks match; the last one is the fallback."""
    template = tokenizer.chat_template
    source = template.source if template is not None and template.takes_tools else ""
    for cls in formats[:-1]:
        if source and cls.matches(source):
            return cls(tokenizer)
    return formats[-1](tokenizer)
