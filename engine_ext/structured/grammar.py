"""Grammars for constrained decoding, compiled and matched by llguidance.

A request that must answer in a shape (a JSON Schema, a tool call) carries a `Grammar`.
Before each sampled token the sequence's `TokenConstraint` computes which tokens the
grammar allows next and the sampler masks every other logit to -inf; after the token is
chosen the constraint consumes it. When the grammar is complete only the end-of-sequence
tokens remain allowed, so the answer ends exactly where the grammar does.

Why llguidance (the README compares it with xgrammar and outlines-core on this CPU): it
computes a mask in tens of microseconds on SmolLM2's 49k vocabulary without compiling
a whole automaton up front, covers JSON Schema broadly, and takes one grammar language
(a Lark dialect) in which a JSON Schema can sit inside a larger grammar (`%json {...}`)
and special tokens can be named (`<[id]>`): "text or a tool call" is one grammar.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from engine_ext.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's Lark dialect, and the request field it came from (named in errors)."""

    lark: str
    param: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str, lenient: bool = False) -> Grammar:
        return cls(f"start: {json_rule(schema, lenient)}\n", param)


def json_rule(schema: dict[str, Any], lenient: bool = False) -> str:
    """A Lark expression matching compact JSON valid against `schema`. `lenient`: JSON
    Schema keywords llguidance cannot enforce are ignored instead of refused.

    Two narrowings keep a small model from writing until max_tokens, and every answer
    they allow is still valid against the schema as given: whitespace is not flexible
    (a model free to add it can loop on newlines), and an object schema that lists its
    properties, and says nothing else about other keys, allows only those (a model free
    to add keys invents them one after another)."""
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": lenient}
    body = {k: v for k, v in close_objects(schema).items() if k != "x-guidance"}
    return f"%json {json.dumps({**body, 'x-guidance': options})}"


# Where a JSON Schema keeps subschemas: only these are walked, so a property named
# "definitions" or a `const` holding "$ref" is data, never rewritten.
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else",
                  "contains", "propertyNames")
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "if", "not", "dependentSchemas")


def map_subschemas(schema: dict[str, Any], fn: Callable[[Any, str], Any]) -> dict[str, Any]:
    """A copy of `schema` with `fn(subschema, keyword)` applied to each direct subschema."""
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(sub, key) for sub in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: fn(sub, key) for name, sub in out[key].items()}
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key], key)
    return out


def close_objects(schema: Any, in_all_of: bool = False) -> Any:
    """A copy of `schema` in which an object schema that lists `properties`, and says
    nothing else about other keys, sets `additionalProperties: false`.

    Left open: an object that composes with others (allOf members, $ref or anyOf
    siblings: another part may bring the keys), one whose `required` names keys it does
    not list, and a bare {"type": "object"} (json_object mode asks for any object)."""
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, lambda sub, key: close_objects(sub, key == "allOf"))
    properties = out.get("properties")
    required = out.get("required")
    if not isinstance(required, list):
        required = []
    if isinstance(properties, dict) and not in_all_of \
            and not any(k in out for k in ("additionalProperties", "unevaluatedProperties", *_COMPOSED)) \
            and "patternProperties" not in out and all(name in properties for name in required):
        out["additionalProperties"] = False
    return out


class SchemaDocument:
    """One JSON Schema assembled from others (a call object around a tool's parameters,
    the generic format's answer around an app's response schema).

    Each embedded schema goes under the root's $defs whole, and its references follow
    it: "#" and "#/..." in a tool's parameters meant the parameters' own root, which is
    now "#/$defs/<name>"."""

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}

    def embed(self, schema: dict[str, Any]) -> dict[str, Any]:
        """A reference to `schema`, which the document's root will hold."""
        name = f"_embedded{len(self.defs)}"
        body = {k: v for k, v in schema.items() if k != "x-guidance"}
        self.defs[name] = _rebased(body, f"#/$defs/{name}")
        return {"$ref": f"#/$defs/{name}"}

    def root(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {**schema, "$defs": {**schema.get("$defs", {}), **self.defs}} if self.defs else schema


def _rebased(schema: Any, base: str) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, lambda sub, _: _rebased(sub, base))
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


class TokenConstraint:
    """One sequence's position in its grammar. Not thread-safe: the engine thread owns it."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._eos_ids = sorted(eos_ids)

    def mask_(self, logits: torch.Tensor) -> None:
        """Set the logits (vocab,) of every token the grammar forbids next to -inf, in place."""
        if self._matcher.is_error():
            # Cannot happen while every token went through this mask; if it does, end the
            # answer rather than sample outside the grammar.
            logger.warning("grammar matcher in error state: %s", self._matcher.get_error())
            allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
            allowed[self._eos_ids] = True
        else:
            bias = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8)
            allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
            width = min(bias.shape[0], logits.shape[-1])
            allowed[:width] = bias[:width] != 0
        logits.masked_fill_(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past the sampled token (end-of-sequence included)."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token)

    @property
    def is_complete(self) -> bool:
        return self._matcher.is_accepting()


class GrammarCompiler:
    """Checks grammars against the model's vocabulary and makes per-sequence constraints.

    The llguidance tokenizer (built once, ~0.2 s for a 49k vocabulary) maps every token
    id to its bytes, so masks are computed over exactly the ids the model emits."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: frozenset[int]) -> None:
        if not eos_ids:
            raise ValueError("constrained decoding needs at least one end-of-sequence token")
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._eos_ids = eos_ids

    def constraint(self, grammar: Grammar) -> TokenConstraint:
        """A fresh constraint at the grammar's start; InvalidRequestError naming the
        grammar's field when it does not compile (an unsupported or contradictory schema)."""
        try:
            source = llguidance.LLMatcher.grammar_from_lark(grammar.lark)
        except ValueError as exc:
            raise InvalidRequestError(f"{grammar.param}: {exc}", param=grammar.param) from exc
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{grammar.param}: cannot be enforced: {_first_line(matcher.get_error())}",
                                      param=grammar.param)
        return TokenConstraint(matcher, self._eos_ids)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown grammar error"
