"""What a chat request's answer must look like, and how the prompt tells the model.

`tools`, `tool_choice`, `parallel_tool_calls` and `response_format` decide three things
together: the messages and tools the chat template renders (a tool format may rewrite
them, engine_ext/tools/formats), the grammar the answer must follow (engine_ext/
structured), and the format that reads the answer back into content and tool calls.

tool_choice "none" renders no tools, so the model cannot write a call it was told not
to; "auto" renders them and lets the model choose; "required" and a named function
are enforced by grammar. response_format json_object and json_schema constrain the
text answer; with tools on "auto" the answer is that JSON or a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrelay.wire.plan import SegmentPlan
from engine_ext.server.schemas import ChatCompletionRequest, JsonObjectFormat, JsonSchemaFormat, NamedToolChoice
from engine_ext.structured.grammar import Grammar, json_rule
from engine_ext.tools.calls import ParsedAnswer, ToolCall
from engine_ext.tools.formats import Choice, Function, ToolFormat
from engine_ext.tools.formats.base import Named, Reading, TextSchema
from engine_ext.tools.stream import AnswerStream


@dataclass(frozen=True)
class ChatShape:
    messages: list[dict[str, Any]]  # as the template renders them
    tools: list[dict[str, Any]] | None  # as the template takes them
    index_map: list[int]  # the request's message i is messages[index_map[i]]
    grammar: Grammar | None  # None: the model is free
    format: ToolFormat | None  # reads calls out of the answer; None: the answer is content
    reading: Reading = Reading(frozenset())
    single_call: bool = False  # parallel_tool_calls false: an answer keeps at most its first call

    def parse(self, text: str) -> ParsedAnswer:
        """The finished answer's content and tool calls."""
        answer = self.format.parse(text, self.reading) if self.format is not None else ParsedAnswer(text)
        return ParsedAnswer(answer.content, self.kept(answer.calls))

    def stream(self) -> AnswerStream | None:
        """A reader of the answer while it streams; None: every delta is content."""
        return self.format.stream(self.reading) if self.format is not None else None

    def kept(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        return calls[:1] if self.single_call else calls

    def plan_for_template(self, plan: SegmentPlan) -> SegmentPlan:
        """The plan with its segments moved to where their messages went."""
        if self.index_map == list(range(len(self.index_map))):
            return plan
        moved = [s.model_copy(update={"message_index": self.index_map[s.message_index]})
                 if s.message_index < len(self.index_map) else s for s in plan.segments]
        return plan.model_copy(update={"segments": moved})


def shape_chat(req: ChatCompletionRequest, fmt: ToolFormat) -> ChatShape:
    messages = [m.to_template() for m in req.messages]
    identity = list(range(len(messages)))
    text = _text_schema(req)
    choice = _choice(req)
    if choice is None:
        grammar = Grammar(f"start: {json_rule(text.schema, not text.strict)}\n", "response_format") if text else None
        return ChatShape(messages, None, identity, grammar, None)
    functions = [Function(t.function.name, t.function.description, t.function.parameters,
                          bool(t.function.strict)) for t in req.tools or ()]
    # A grammar allows several calls in one answer only when the client asked for them:
    # a small model allowed a list of calls tends to repeat the first until max_tokens,
    # and one call is a valid answer either way.
    parallel = req.parallel_tool_calls is True
    # The prompt follows the request's choice; the grammar, the choice this answer is
    # made under (a format may decide "auto" for a model that cannot).
    prepared = fmt.prepare(messages, functions, choice, parallel)
    grammar = fmt.grammar(functions, fmt.effective_choice(messages, choice), parallel, text)
    reading = Reading(frozenset(f.name for f in functions), json_text=text is not None)
    return ChatShape(prepared.messages, prepared.tools, prepared.index_map, grammar, fmt, reading,
                     single_call=req.parallel_tool_calls is False)


def _choice(req: ChatCompletionRequest) -> Choice | None:
    """The tool choice in effect; None: no tools reach the model."""
    if not req.tools or req.tool_choice == "none":
        return None
    if isinstance(req.tool_choice, NamedToolChoice):
        return Named(req.tool_choice.function.name)
    return req.tool_choice or "auto"


def _text_schema(req: ChatCompletionRequest) -> TextSchema | None:
    """The JSON a text answer must be; None for free text. Under strict every keyword
    must be enforced (an unsupported one is a 400); otherwise unknown keywords are
    ignored, as OpenAI's non-strict mode does."""
    fmt = req.response_format
    if isinstance(fmt, JsonObjectFormat):
        return TextSchema({"type": "object"}, strict=False)
    if isinstance(fmt, JsonSchemaFormat):
        return TextSchema(fmt.json_schema.json_schema or {"type": "object"}, bool(fmt.json_schema.strict))
    return None
