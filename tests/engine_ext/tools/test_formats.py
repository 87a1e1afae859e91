"""Tool formats: which template gets which format, each format's grammar over its own
call syntax, and reading calls back (whole, and as the answer streams)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine_ext.structured.grammar import Grammar, GrammarCompiler
from engine_ext.tokenizer import Tokenizer
from engine_ext.tools.formats import FORMATS, Function, pick_format
from engine_ext.tools.formats.base import Named, Reading, TextSchema
from engine_ext.tools.formats.generic import GenericFormat
from engine_ext.tools.formats.hermes import HermesFormat
from engine_ext.tools.formats.llama3 import Llama3JsonFormat
from engine_ext.tools.formats.mistral import MistralFormat

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"
WEATHER = Function("get_weather", "Weather in a city",
                   {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
ADD = Function("add", None, {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                             "required": ["a", "b"]})
READ = Reading(frozenset({"get_weather", "add"}))
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "generic": '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
}


@pytest.fixture(scope="module")
def tokenizer_with(tiny_tokenizer_dir, tmp_path_factory) -> Callable[[str | None], Tokenizer]:
    def make(template: str | None) -> Tokenizer:
        out = tmp_path_factory.mktemp("tok")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tiny_tokenizer_dir[0]) / name, out / name)
        if template is not None:
            (out / "chat_template.jinja").write_text((TEMPLATES / f"{template}.jinja").read_text())
        return Tokenizer(out)
    return make


@pytest.fixture(scope="module")
def compiler(tokenizer_with) -> GrammarCompiler:
    tok = tokenizer_with(None)
    return GrammarCompiler(tok.to_json(), tok.vocab_size, frozenset({tok.token_id("<|im_end|>")}))


def walks(compiler: GrammarCompiler, tok: Tokenizer, grammar: Grammar, text: str) -> bool:
    constraint = compiler.constraint(grammar)
    for token in tok.encode(text):
        logits = torch.zeros(tok.vocab_size)
        constraint.mask_(logits)
        if logits[token] != 0:
            return False
        constraint.accept(token)
    return constraint.is_complete


@pytest.mark.parametrize(("template", "expected"), [("hermes", HermesFormat), ("llama3", Llama3JsonFormat),
                                                    ("mistral", MistralFormat), (None, GenericFormat)])
def test_the_template_decides_the_format(tokenizer_with, template, expected):
    assert type(pick_format(tokenizer_with(template), FORMATS)) is expected


@pytest.mark.parametrize("template", ["hermes", "llama3", "mistral", None])
def test_required_and_named_choices_admit_exactly_the_formats_own_call(tokenizer_with, compiler, template):
    tok = tokenizer_with(template)
    fmt = pick_format(tok, FORMATS)
    call = CALLS[fmt.name]
    required = fmt.grammar([WEATHER, ADD], "required", False, None)
    assert walks(compiler, tok, required, call)
    assert not walks(compiler, tok, required, "It is sunny in Paris.")
    assert not walks(compiler, tok, required, call.replace('"Paris"', "42"))  # arguments follow the schema
    named = fmt.grammar([WEATHER, ADD], Named("add"), False, None)
    assert not walks(compiler, tok, named, call)  # only the named function
    parsed = fmt.parse(call, READ)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("template", ["hermes", "llama3", "mistral"])
def test_auto_leaves_a_native_model_free_unless_the_text_is_json(tokenizer_with, compiler, template):
    tok = tokenizer_with(template)
    fmt = pick_format(tok, FORMATS)
    assert fmt.grammar([WEATHER], "auto", False, None) is None
    both = fmt.grammar([WEATHER], "auto", False, TextSchema({"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}, strict=True))
    assert walks(compiler, tok, both, '{"x": 3}')
    assert walks(compiler, tok, both, CALLS[fmt.name])
    assert not walks(compiler, tok, both, "free text")


def test_generic_auto_is_a_call_or_a_response(tokenizer_with, compiler):
    tok = tokenizer_with(None)
    fmt = pick_format(tok, FORMATS)
    grammar = fmt.grammar([WEATHER], "auto", False, None)
    assert walks(compiler, tok, grammar, CALLS["generic"])
    assert walks(compiler, tok, grammar, '{"response": "It is \\"sunny\\"."}')
    assert not walks(compiler, tok, grammar, "It is sunny.")
    assert fmt.parse('{"response": "It is \\"sunny\\"."}', READ).content == 'It is "sunny".'
    typed = fmt.grammar([WEATHER], "auto", False, TextSchema({"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}, strict=True))
    assert walks(compiler, tok, typed, '{"response": {"x": 3}}')
    assert walks(compiler, tok, typed, CALLS["generic"])
    assert not walks(compiler, tok, typed, '{"response": "text"}')
    assert fmt.parse('{"response": {"x": 3}}', Reading(READ.names, json_text=True)).content == '{"x": 3}'
    assert fmt.parse('{"response": "hi"}', Reading(READ.names, json_text=True)).content == '"hi"'  # JSON text


def test_parallel_calls_only_when_asked(tokenizer_with, compiler):
    tok = tokenizer_with("hermes")
    fmt = pick_format(tok, FORMATS)
    two = CALLS["hermes"] + "\n" + CALLS["hermes"].replace("Paris", "Rome")
    assert walks(compiler, tok, fmt.grammar([WEATHER], "required", True, None), two)
    assert not walks(compiler, tok, fmt.grammar([WEATHER], "required", False, None), two)
    assert [json.loads(c.arguments)["city"] for c in fmt.parse(two, READ).calls] == ["Paris", "Rome"]


@pytest.mark.parametrize(("fmt_cls", "text", "content", "names"), [
    (HermesFormat, 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Let me check.\n", ["f"]),
    (HermesFormat, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, ["f"]),  # unterminated last block
    (HermesFormat, "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (HermesFormat, "plain", "plain", []),
    (Llama3JsonFormat, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     ["f", "g"]),
    (Llama3JsonFormat, '{"not": "a call"}', '{"not": "a call"}', []),
    (Llama3JsonFormat, '{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),  # JSON, not a call
    (Llama3JsonFormat, '{"name": "f"}', '{"name": "f"}', []),  # no arguments key: not a call
    (HermesFormat, 'Hi <tool_call>\n{"name": "f", "argu', "Hi ", []),  # cut by max_tokens: no call, no markup
    (HermesFormat, '<tool_call>\n{"name": "zzz", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "zzz", "arguments": {}}\n</tool_call>', []),  # not one of the tools
    (MistralFormat, '[{"name": "Alice"}]', '[{"name": "Alice"}]', []),
    (GenericFormat, '{"tool_call": {"name": "f", "arguments": {"x": NaN}}}', '{"tool_call": {"name": "f", "arguments": {"x": NaN}}}', []),
    (GenericFormat, "[" * 5000, None, []),  # nested past the recursion limit: no call, no 500
    (Llama3JsonFormat, '{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    (MistralFormat, '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": "{}"}]', None, ["f", "g"]),
    (MistralFormat, "[1, 2]", "[1, 2]", []),
    (GenericFormat, '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]}', None, ["f", "g"]),
    (GenericFormat, '{"response": {"x": 1}}', '{"x": 1}', []),
    (GenericFormat, '{"tool_call": {"name": "f", "arg', None, []),  # an unfinished call, cut by length
    (GenericFormat, '{"tool_calls": [{"name": "f"', None, []),
    (GenericFormat, '{"tool_', None, []),  # the opening not yet decided
    (GenericFormat, '{"response": "cut \\"sh', 'cut "sh', []),  # cut by length: the decoded part
])
def test_parse(tokenizer_with, fmt_cls, text, content, names):
    parsed = fmt_cls(tokenizer_with(None)).parse(text, Reading(frozenset({"f", "g"})))
    assert parsed.content == content
    assert [c.name for c in parsed.calls] == names
    assert all(isinstance(json.loads(c.arguments), dict) for c in parsed.calls)


def test_mistral_call_ids_have_the_shape_its_template_demands(tokenizer_with):
    call = MistralFormat(tokenizer_with(None)).parse('[{"name": "f", "arguments": {}}]', Reading(frozenset("f"))).calls[0]
    assert len(call.id) == 9 and call.id.isalnum()


def _stream_all(fmt, text: str, step: int = 3) -> tuple[list[str], str, tuple]:
    reader, deltas = fmt.stream(Reading(frozenset({"f"}))), []
    for end in range(step, len(text) + step, step):
        deltas.append(reader.feed(text[:end]))
    rest, calls = reader.finish(text)
    return deltas, rest, calls


@pytest.mark.parametrize("fmt_cls", [HermesFormat, Llama3JsonFormat, MistralFormat, GenericFormat])
def test_a_stream_sends_the_same_content_and_calls_as_the_whole_answer(tokenizer_with, fmt_cls):
    fmt = fmt_cls(tokenizer_with(None))
    answers = {
        HermesFormat: ["Sure: <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "a <tool_c b", "plain",
                       "\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "text \n\n"],
        Llama3JsonFormat: ['{"name": "f", "parameters": {}}', "  plain text", "{ not json"],
        MistralFormat: ['[TOOL_CALLS][{"name": "f", "arguments": {}}]', "plain", "[not json"],
        GenericFormat: ['{"tool_call": {"name": "f", "arguments": {}}}', '{"response": "a\\"b\\u00e9\\ud83d\\ude00 c"}',
                        '{"response": "cut sh', '{"tool_call": {"name": "f", "argu'],
    }[fmt_cls]
    for text in answers:
        for step in (1, 2, 5):
            deltas, rest, calls = _stream_all(fmt, text, step)
            whole = fmt.parse(text, Reading(frozenset({"f"})))
            streamed = "".join(deltas) + rest
            assert streamed == (whole.content or ""), (text, step)
            assert [c.name for c in calls] == [c.name for c in whole.calls]


def test_a_marker_stream_holds_back_a_partial_marker(tokenizer_with):
    reader = HermesFormat(tokenizer_with(None)).stream(READ)
    assert reader.feed("Hello <tool") == "Hello"  # the space may be all there is before a call
    assert reader.feed("Hello <tool_call>\n{") == ""
    assert reader.feed("Hello <tool_call>\n{\"name\"") == ""


def test_generic_prepare_keeps_the_system_prompt_first_and_maps_messages(tokenizer_with):
    fmt = GenericFormat(tokenizer_with(None))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "Rain"}]
    prepared = fmt.prepare(messages, [WEATHER], "auto", False)
    assert prepared.tools is None
    assert prepared.messages[0] == messages[0]
    assert prepared.messages[1]["role"] == "system" and "get_weather" in prepared.messages[1]["content"]
    assert prepared.index_map == [0, 2, 3, 4]
    assert json.loads(prepared.messages[3]["content"]) == {"tool_call": {"name": "get_weather",
                                                                        "arguments": {"city": "Oslo"}}}
    assert prepared.messages[4] == messages[3]  # tool results as sent


def test_generic_call_first_policy_calls_on_a_user_turn_and_answers_after_results(tokenizer_with, compiler):
    fmt = GenericFormat(tokenizer_with(None))
    user = [{"role": "user", "content": "Weather?"}]
    after = user + [{"role": "assistant", "content": "{}"}, {"role": "tool", "content": "Rain"}]
    assert fmt.effective_choice(user, "auto") == "required"
    assert fmt.effective_choice(after, "auto") == "respond"
    assert fmt.effective_choice(after + [{"role": "assistant", "content": "x"}], "auto") == "auto"
    assert fmt.effective_choice(user, Named("get_weather")) == Named("get_weather")
    assert fmt.effective_choice(after, "required") == "required"
    tok = tokenizer_with(None)
    respond = fmt.grammar([WEATHER], "respond", False, None)
    assert walks(compiler, tok, respond, '{"response": "Rain."}')
    assert not walks(compiler, tok, respond, CALLS["generic"])
    # The prompt does not change with the decision: the system message follows the request.
    assert fmt.prepare(user, [WEATHER], "auto", False).messages[0] == fmt.prepare(after, [WEATHER], "auto",
                                                                                   False).messages[0]
    fmt.auto_policy = "model"
    assert fmt.effective_choice(user, "auto") == "auto"
    assert fmt.effective_choice(after, "auto") == "auto"


@pytest.mark.parametrize("template", ["hermes", "llama3", "mistral"])
def test_native_templates_render_tools_and_a_history_of_calls(tokenizer_with, template):
    from engine_ext.server.schemas import ChatMessage

    tok = tokenizer_with(template)
    history = [ChatMessage(role="user", content="Weather?"),
               ChatMessage(role="assistant", content=None, tool_calls=[
                   {"id": "abcdefgh1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
               ChatMessage(role="tool", tool_call_id="abcdefgh1", content="Rain"),
               ChatMessage(role="user", content="And tomorrow?")]
    text = tok.render_chat([m.to_template() for m in history], tools=[WEATHER.to_template()])
    assert '"get_weather"' in text and "Rain" in text
    assert '{"city": "Oslo"}' in text  # the arguments object, not a JSON string encoded twice
