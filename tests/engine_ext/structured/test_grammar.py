"""The grammar layer: what json_rule narrows, and a constraint's mask and walk over a
real tokenizer (the tiny trained one)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from engine_ext.errors import InvalidRequestError
from engine_ext.structured.grammar import Grammar, GrammarCompiler, close_objects
from engine_ext.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir) -> Tokenizer:
    return Tokenizer(Path(tiny_tokenizer_dir[0]))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, frozenset({tokenizer.token_id("<|im_end|>")}))


def _allowed(constraint, vocab: int) -> set[int]:
    logits = torch.zeros(vocab)
    constraint.mask_(logits)
    return set(torch.nonzero(logits == 0).flatten().tolist())


def _walk(compiler: GrammarCompiler, tokenizer: Tokenizer, grammar: Grammar, text: str) -> bool:
    """Whether every token of `text` is allowed in turn, and the grammar is then complete."""
    constraint = compiler.constraint(grammar)
    for token in tokenizer.encode(text):
        if token not in _allowed(constraint, tokenizer.vocab_size):
            return False
        constraint.accept(token)
    return constraint.is_complete


def test_close_objects_closes_every_nested_object_the_schema_leaves_open():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"properties": {"y": {"type": "string"}}}},
        "c": {"anyOf": [{"type": "object", "properties": {}}, {"type": "object"}, {"type": "null"}]},
        "d": {"type": "object", "additionalProperties": {"type": "integer"}},
        "e": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}},
        "$defs": {"p": {"type": "object", "properties": {}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert closed["properties"]["c"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["c"]["anyOf"][1]  # any object: stays open
    assert closed["properties"]["d"]["additionalProperties"] == {"type": "integer"}  # said: kept
    assert "additionalProperties" not in closed["properties"]["e"]  # patterns decide
    assert closed["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is untouched


def test_closing_only_narrows_an_answer_stays_valid_against_the_schema_as_given():
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    jsonschema.validate({"name": "x"}, close_objects(schema))
    jsonschema.validate({"name": "x"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "x", "other": 1}, close_objects(schema))


def test_a_constraint_allows_exactly_the_schema_and_then_only_the_end(compiler, tokenizer):
    grammar = Grammar.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                   "required": ["ok"]}, "response_format")
    assert _walk(compiler, tokenizer, grammar, '{"ok": true}')
    assert not _walk(compiler, tokenizer, grammar, '{"ok": 1}')
    assert not _walk(compiler, tokenizer, grammar, '{"ok": true, "x": 1}')  # closed
    assert not _walk(compiler, tokenizer, grammar, '{"ok":true}')  # compact, with one space after ':'
    constraint = compiler.constraint(grammar)
    for token in tokenizer.encode('{"ok": false}'):
        constraint.accept(token)
    assert _allowed(constraint, tokenizer.vocab_size) == {tokenizer.token_id("<|im_end|>")}


def test_masked_logits_never_lead_outside_the_grammar(compiler, tokenizer):
    """Sampling at random from masked logits always yields a valid document."""
    grammar = Grammar.json_schema({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"]}, "response_format")
    gen = torch.Generator().manual_seed(0)
    eos = tokenizer.token_id("<|im_end|>")
    for _ in range(5):
        constraint, out = compiler.constraint(grammar), []
        for _ in range(60):
            logits = torch.randn(tokenizer.vocab_size, generator=gen)
            constraint.mask_(logits)
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            constraint.accept(token)
            if token == eos:
                break
            out.append(token)
        data = json.loads(tokenizer.decode(out))
        assert 0 <= data["n"] <= 9 and data["tag"] in ("a", "b")


def test_json_object_mode_allows_any_object(compiler, tokenizer):
    grammar = Grammar.json_schema({"type": "object"}, "response_format")
    assert _walk(compiler, tokenizer, grammar, '{"a": [1, {"b": null}], "c": "d"}')
    assert not _walk(compiler, tokenizer, grammar, '[1]')


def test_a_grammar_that_cannot_compile_is_a_400_naming_its_field(compiler):
    with pytest.raises(InvalidRequestError) as err:
        compiler.constraint(Grammar("start: %json {\"type\": \"nonsense-type\"}\n", "response_format"))
    assert err.value.param == "response_format"
    with pytest.raises(InvalidRequestError) as err:
        compiler.constraint(Grammar("start: undefined_rule\n", "tool_choice"))
    assert err.value.param == "tool_choice"


def _document(inner: dict) -> dict:
    from engine_ext.structured.grammar import SchemaDocument

    doc = SchemaDocument()
    return doc.root({"type": "object", "properties": {"call": doc.embed(inner)}, "required": ["call"]})


def test_an_embedded_schema_keeps_its_definitions_and_its_own_root(compiler, tokenizer):
    tree = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}, "kind": {"$ref": "#/$defs/kind"},
                                             "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["label"], "$defs": {"kind": {"type": "integer"}}}
    outer = _document(tree)
    jsonschema.validate({"call": {"label": "a", "kind": 2, "children": [{"label": "b"}]}}, outer)
    with pytest.raises(jsonschema.ValidationError):  # "#" is the tree's root, not the wrapper's
        jsonschema.validate({"call": {"label": "a", "children": [{"call": {"label": "b"}}]}}, outer)
    grammar = Grammar.json_schema(outer, "tool_choice")
    assert _walk(compiler, tokenizer, grammar, '{"call": {"label": "a", "kind": 3, "children": [{"label": "b"}]}}')
    assert not _walk(compiler, tokenizer, grammar, '{"call": {"label": "c"}}')


def test_a_property_named_definitions_is_data_not_a_definitions_block(compiler, tokenizer):
    word = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5},
                                             "definitions": {"type": "array", "items": {"enum": ["x"]}}},
            "required": ["word", "definitions"]}
    grammar = Grammar.json_schema(_document(word), "tool_choice")
    assert _walk(compiler, tokenizer, grammar, '{"call": {"word": "hi", "definitions": ["x"]}}')


def test_composed_objects_stay_open_so_a_valid_schema_stays_satisfiable(compiler, tokenizer):
    both = {"allOf": [{"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]},
                      {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert _walk(compiler, tokenizer, Grammar.json_schema(both, "response_format"), '{"a": "x", "b": 1}')
    outside = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "z"]}
    assert _walk(compiler, tokenizer, Grammar.json_schema(outside, "response_format"), '{"a": 1, "z": 2}')
    assert "additionalProperties" not in close_objects(outside)
    assert "additionalProperties" not in close_objects({"$ref": "#/$defs/x", "properties": {}})
