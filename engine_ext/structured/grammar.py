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
    def json_schema(cls, schema: dict[str, Any], param: str) -> Grammar:
        return cls(f"start: {json_rule(schema)}\n", param)


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark expression matching compact JSON valid against `schema`.

    Two narrowings keep a small model from writing until max_tokens, and every answer
    they allow is still valid against the schema as given: whitespace is not flexible
    (a model free to add it can loop on newlines), and an object schema that does not
    say whether other keys are allowed allows only the ones it lists (a model free to add keys invents
    them one after another)."""
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    closed = close_objects(hoist_defs(schema))
    return f"%json {json.dumps({**closed, 'x-guidance': {**options, **schema.get('x-guidance', {})}})}"


_DEFS = ("$defs", "definitions")


def hoist_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` with the definitions of embedded schemas moved to its root.

    A tool's parameters or an app's response schema, once placed inside a larger one (a
    call object, the generic format's answer), still say `#/$defs/x` meaning their own
    root; JSON Pointers resolve from the whole document's root. Each nested definitions
    block moves to the root under fresh names, and the references inside it follow."""
    root_defs: dict[str, Any] = dict(schema.get("$defs", {})) if isinstance(schema.get("$defs"), dict) else {}
    fresh = iter(range(1 << 30))

    def walk(node: Any, renames: dict[str, str], is_root: bool = False) -> Any:
        if isinstance(node, list):
            return [walk(item, renames) for item in node]
        if not isinstance(node, dict):
            return node
        moved = {key: node[key] for key in _DEFS if not is_root and isinstance(node.get(key), dict)}
        local: dict[str, str] = {}
        for key, block in moved.items():
            tag = next(fresh)
            local.update({f"#/{key}/{name}": f"#/$defs/_{tag}_{name}" for name in block})
        scope = {**renames, **local}
        out = {}
        for key, value in node.items():
            if key in moved or (is_root and key == "$defs"):
                continue
            out[key] = _renamed(value, scope) if key == "$ref" else walk(value, scope)
        for key, block in moved.items():
            for name, sub in block.items():
                root_defs[local[f"#/{key}/{name}"].removeprefix("#/$defs/")] = walk(sub, scope)
        return out

    out = walk(schema, {}, is_root=True)
    if isinstance(schema.get("$defs"), dict):
        for name, sub in schema["$defs"].items():
            root_defs[name] = walk(sub, {})
    if root_defs:
        out["$defs"] = root_defs
    return out


def _renamed(ref: Any, renames: dict[str, str]) -> Any:
    if isinstance(ref, str):
        for old, new in renames.items():
            if ref == old or ref.startswith(old + "/"):
                return new + ref[len(old):]
    return ref


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that lists `properties` but not
    `additionalProperties` (nor `patternProperties`, which decide instead) sets it to false."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    # Only an object that lists its properties is closed: a bare {"type": "object"}
    # (json_object mode) asks for any object, and closing it would allow only {}.
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
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

    def special_token(self, token_id: int) -> str:
        """The Lark term for one token by id (a special token has no text to match)."""
        return f"<[{token_id}]>"


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown grammar error"
