"""One grammar library measured over JSON Schemas, in a process of the python that has it.

`kvrelay bench grammars` (benchmarks/grammars.py) runs this file as a script with the
interpreter that can import the library (xgrammar and outlines-core live only in the
vLLM venv), so it imports nothing from kvrelay: the standard library, numpy and the
library. It reads a job from stdin ({"library", "tokenizer_json", "eos", "vocab_size",
"cases": [{"index", "schema", "tokens", "invalid": {kind: tokens}}], "embedded":
{"schema", "tokens"} | null}) and prints one JSON line per event, flushed, so that the
parent keeps what was measured when it kills a case that runs past its time limit:
{"event": "setup"}, then {"event": "case"} per schema, {"event": "embedded"}, {"event": "done"}.

All three libraries get the same vocabulary (tokenizer.json's byte-level tokens; special
tokens never allowed, EOS only where the JSON may end) and the same grammar: compact
JSON, no whitespace between tokens, properties in declared order. A case compiles the
schema, then walks the valid instance's tokens and then EOS: before each token it fills
the whole token bitmask (what a sampler does per decode step, timed) and checks the
token is allowed; a forbidden valid token ends the walk and is counted as rejected.
Then, reset, it walks instances that break one keyword (a number past its maximum, a
string past its maxLength): a library that lets one through to EOS ignores that keyword.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import numpy as np

TOOL_BEGIN, TOOL_END = "<tool_call>", "</tool_call>"


@dataclass
class Backend:
    """A library behind three calls: compile a schema (or a tool call in free text), fill, consume."""

    version: str
    compile: Callable[[dict], Any]
    compile_embedded: Callable[[dict], Any]
    fill: Callable[[Any, np.ndarray], None]
    consume: Callable[[Any, int], bool]
    reset: Callable[[Any], Any]


def byte_vocab(tokenizer: dict) -> tuple[list[bytes], set[int]]:
    """Every token id's bytes (byte-level BPE's characters mapped back) and the special ids."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    to_byte: dict[str, int] = {chr(b): b for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in printable):
        to_byte[chr(256 + extra)] = b
    added = tokenizer.get("added_tokens", [])
    specials = {t["id"] for t in added if t["special"]}
    size = 1 + max([*tokenizer["model"]["vocab"].values(), *(t["id"] for t in added)])
    tokens = [b""] * size
    for text, index in tokenizer["model"]["vocab"].items():
        tokens[index] = bytes(to_byte[c] for c in text)
    for t in added:
        tokens[t["id"]] = b"" if t["special"] else t["content"].encode()
    return tokens, specials


def _llguidance(job: dict, tokens: list[bytes], specials: set[int]) -> Backend:
    import llguidance

    with open(job["tokenizer_json"], encoding="utf-8") as f:
        tok = llguidance.LLTokenizer(f.read(), n_vocab=job["vocab_size"], eos_token=job["eos"])
    options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def matcher(grammar: str) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def embedded(schema: dict) -> llguidance.LLMatcher:
        lark = f'start: TEXT "{TOOL_BEGIN}" %json {json.dumps(schema)} "{TOOL_END}"\nTEXT: /[^<]*/\n'
        return matcher(llguidance.LLMatcher.grammar_from_lark(lark))

    def consume(m: llguidance.LLMatcher, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()

    return Backend(version("llguidance"),
                   lambda s: matcher(llguidance.LLMatcher.grammar_from_json_schema(s, defaults=options)),
                   embedded, lambda m, buf: m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes), consume,
                   lambda m: m.reset())


def _xgrammar(job: dict, tokens: list[bytes], specials: set[int]) -> Backend:
    import xgrammar as xgr

    # xgrammar takes a token that decodes to nothing for a special one: never allowed.
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=job["vocab_size"], stop_token_ids=[job["eos"]])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile_schema(schema: dict) -> xgr.GrammarMatcher:
        grammar = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        return xgr.GrammarMatcher(grammar)

    def embedded(schema: dict) -> xgr.GrammarMatcher:
        tag = {"type": "tag", "begin": TOOL_BEGIN, "end": TOOL_END,
               "content": {"type": "json_schema", "json_schema": schema}}
        fmt = {"type": "triggered_tags", "triggers": [TOOL_BEGIN], "tags": [tag], "at_least_one": False,
               "stop_after_first": True}
        return xgr.GrammarMatcher(compiler.compile_structural_tag({"type": "structural_tag", "format": fmt}))

    return Backend(version("xgrammar"), compile_schema, embedded, lambda m, buf: m.fill_next_token_bitmask(buf),
                   lambda m, token: m.accept_token(token), lambda m: m.reset())


def _outlines_core(job: dict, tokens: list[bytes], specials: set[int]) -> Backend:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    mapping: dict[bytes, list[int]] = {}
    for index, token in enumerate(tokens):
        if token and index not in specials and index != job["eos"]:
            mapping.setdefault(token, []).append(index)
    vocabulary = Vocabulary(job["eos"], mapping)

    def guide(regex: str) -> Guide:
        return Guide(Index(regex, vocabulary))

    def regex(schema: dict) -> str:
        return build_regex_from_schema(json.dumps(schema), whitespace_pattern="")

    def consume(g: Guide, token: int) -> bool:
        try:
            g.advance(token, return_tokens=False)
        except ValueError:  # "No next state found": the token does not fit
            return False
        return True

    return Backend(version("outlines_core"), lambda s: guide(regex(s)),
                   lambda s: guide(f"[^<]*{TOOL_BEGIN}{regex(s)}{TOOL_END}"),
                   lambda g, buf: g.write_mask_into(buf.ctypes.data, buf.size, 4), consume, lambda g: g.reset())


BACKENDS: dict[str, Callable[[dict, list[bytes], set[int]], Backend]] = {
    "llguidance": _llguidance, "xgrammar": _xgrammar, "outlines_core": _outlines_core}


def walk(backend: Backend, matcher: Any, tokens: list[int], eos: int, buf: np.ndarray) -> dict:
    """Mask before every token of a valid output, then before EOS; stop at the first rejection."""
    words = buf.view(np.uint32).reshape(-1)
    mask_us: list[float] = []
    first_allowed = 0  # how many tokens may start the output: the mask is not all ones
    for position, token in enumerate([*tokens, eos]):
        buf.fill(0)  # a library that only sets bits must not inherit the last step's
        start = time.perf_counter_ns()
        backend.fill(matcher, buf)
        mask_us.append((time.perf_counter_ns() - start) / 1e3)
        if position == 0:
            first_allowed = int(np.unpackbits(buf.view(np.uint8)).sum())
        if not (int(words[token >> 5]) >> (token & 31)) & 1:
            return {"mask_us": mask_us, "first_allowed": first_allowed, "rejected": 1, "rejected_at": position,
                    "complete": False}
        if token != eos and not backend.consume(matcher, token):
            return {"mask_us": mask_us, "first_allowed": first_allowed, "rejected": 0, "refused_at": position,
                    "complete": False}
    return {"mask_us": mask_us, "first_allowed": first_allowed, "rejected": 0, "complete": True}


def _emit(event: dict) -> None:
    print(json.dumps(event), flush=True)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, (time.perf_counter() - start) * 1e3


def main() -> None:
    job = json.load(sys.stdin)
    with open(job["tokenizer_json"], encoding="utf-8") as f:
        (tokens, specials), vocab_ms = _timed(lambda: byte_vocab(json.load(f)))
    try:
        backend, setup_ms = _timed(lambda: BACKENDS[job["library"]](job, tokens, specials))
    except ImportError as exc:
        _emit({"event": "setup", "error": f"not installed: {exc}"})
        return
    _emit({"event": "setup", "setup_ms": setup_ms, "vocab_ms": vocab_ms, "version": backend.version,
           "python": sys.executable})
    buf = np.zeros((1, (job["vocab_size"] + 31) // 32), dtype=np.int32)
    for case in job["cases"]:
        event: dict[str, Any] = {"event": "case", "index": case["index"]}
        try:
            matcher, event["compile_ms"] = _timed(lambda: backend.compile(case["schema"]))
        except Exception as exc:  # the library's own error types: recorded as "does not compile"
            event["error"] = f"{type(exc).__name__}: {exc}"[:500]
        else:
            event.update(walk(backend, matcher, case["tokens"], job["eos"], buf))
            event["invalid_accepted"] = {}
            for kind, tokens in case.get("invalid", {}).items():  # each breaks one keyword: must not end
                backend.reset(matcher)
                event["invalid_accepted"][kind] = walk(backend, matcher, tokens, job["eos"], buf)["complete"]
        _emit(event)
    if job.get("embedded"):
        event = {"event": "embedded"}
        try:
            matcher = backend.compile_embedded(job["embedded"]["schema"])
        except Exception as exc:  # recorded: the library cannot express this grammar
            event["error"] = f"{type(exc).__name__}: {exc}"[:500]
        else:
            event.update(walk(backend, matcher, job["embedded"]["tokens"], job["eos"], buf))
        _emit(event)
    _emit({"event": "done"})


if __name__ == "__main__":
    main()
