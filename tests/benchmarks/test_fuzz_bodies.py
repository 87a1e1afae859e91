"""The field fuzzing's own parts, without servers: the strategies draw what they promise
(lone surrogates, NUL, bidi, huge and negative numbers, NaN, wrong types, deep nesting,
in every field OpenAI clients send), deterministically; bodies are encoded byte-exactly;
replies and log tracebacks are read right."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest

from benchmarks.field_fuzz import LogWatch, classify
from benchmarks.fuzz_bodies import CHAT, COMPLETIONS, MODEL, Pairs, Raw, draw_cases, encode, to_bytes

NUM_CASES = 2000
# Every field an OpenAI client sends, and the ones inside messages and content parts.
FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "n", "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "stream",
          "stream_options", "user", "metadata", "prompt", "echo", "suffix", "tools", "tool_choice", "response_format",
          "messages[].role", "messages[].content", "messages[].name", "messages[].tool_call_id",
          "messages[].tool_calls", "messages[].content[].text", "messages[].content[].image_url"}


@pytest.fixture(scope="module")
def cases():
    return draw_cases(NUM_CASES, seed=0)


@pytest.mark.slow
def test_the_same_seed_draws_the_same_cases_and_another_seed_others(cases):
    assert draw_cases(100, seed=0) == cases[:100]
    others = draw_cases(100, seed=1)
    assert sum(a == b for a, b in zip(cases, others)) < 10
    assert len({c.body for c in cases}) > 0.8 * NUM_CASES  # short runs: few cases drawn twice


def test_every_field_is_mutated(cases):
    mutated = {f for c in cases for f in c.fields.split(", ")}
    assert FIELDS <= mutated, FIELDS - mutated
    assert any(f.startswith("x_") for f in mutated), "no unknown field"
    assert {c.endpoint for c in cases} == {CHAT, COMPLETIONS}
    counts = {n: sum(len([m for m in c.mutations if not m.startswith("raw UTF-8")]) == n for c in cases)
              for n in (0, 1, 2)}
    assert counts[1] > counts[2] > counts[0] > 0  # mostly one field, often two, now and then none


def test_hostile_values_are_drawn(cases):
    bodies = [c.body for c in cases]

    def some(pattern: bytes) -> int:
        return sum(bool(re.search(pattern, b)) for b in bodies)

    assert some(rb"\\ud[89ab][0-9a-f]{2}(?!\\ud[c-f])") > 20  # a lone high surrogate, as a JSON escape
    assert some(rb"(?<![0-9a-f]{2}\\u[dD][89abAB][0-9a-fA-F]{2})\\udc00") > 5  # a lone low one
    assert some(rb"\xed[\xa0-\xbf]") > 5  # surrogates as raw bytes: invalid UTF-8
    assert some(rb"\\u0000") > 20 and some(rb"\\u202e") > 20  # NUL, a bidi override
    assert some(rb"[:\[,]1180591620717411303424\b") > 0  # 2**70
    assert some(rb"-9223372036854775809\b") > 0 and some(rb"18446744073709551616\b") > 0  # -2**63-1, 2**64
    assert some(rb"\b(NaN|-?Infinity)\b") > 20 and some(rb"1e400") > 0
    assert some(rb"\[{1001}") > 10  # nesting past Python's recursion limit
    assert max(len(b) for b in bodies) > 20_000


def test_fields_get_the_wrong_types(cases):
    seen: dict[str, set[str]] = defaultdict(set)
    for case in cases:
        try:
            body = json.loads(case.body)
        except (ValueError, RecursionError):
            continue  # broken on purpose, or beyond Python's own parser
        if isinstance(body, dict):
            for key, value in body.items():
                seen[key].add(type(value).__name__)
    wrong = {"model": "str", "max_tokens": "int", "messages": "list", "temperature": "float", "prompt": "str",
             "seed": "int", "stream": "bool"}
    for name, right in wrong.items():
        assert len(seen[name] - {right}) >= 2, (name, seen[name])
    assert {"bool", "NoneType", "dict", "list", "float", "int", "str"} <= set.union(*seen.values())


def test_a_valid_case_is_a_valid_body(cases):
    valid = [c for c in cases if not c.mutations]
    assert valid
    for case in valid:
        body = json.loads(case.body)
        assert body["model"] == MODEL and 1 <= body["max_tokens"] <= 4
        assert body["messages" if case.endpoint == CHAT else "prompt"]


def test_encoding_is_byte_exact():
    assert encode({"a": "\ud800", "b": [float("nan"), float("inf")]}) == '{"a":"\\ud800","b":[NaN,Infinity]}'
    assert to_bytes(encode("\ud800x", ascii_only=False)) == b'"\xed\xa0\x80x"'
    assert encode(Pairs((("model", "m"), ("model", 7)))) == '{"model":"m","model":7}'
    assert encode([Raw("1e400"), 2**70]) == "[1e400,1180591620717411303424]"


@pytest.mark.parametrize(("status", "content_type", "raw", "kind"), [
    (200, "application/json", b'{"choices": []}', "ok"),
    (400, "application/json", b'{"error": {}}', "client_error"),
    (500, "text/plain", b"Internal Server Error", "server_error"),
    (503, "application/json", b'{"error": {"type": "service_unavailable"}}', "server_error"),
    (200, "application/json", b"not json", "bad_body"),
    (200, "text/event-stream", b'data: {"choices": []}\n\ndata: [DONE]\n\n', "ok"),
    (200, "text/event-stream", b'data: {"choices": []}\n\n', "truncated"),
    (200, "text/event-stream", b'data: {"error": {"type": "server_error"}}\n\ndata: [DONE]\n\n', "in_band_error"),
    (200, "text/event-stream", b'data: {"error": {"type": "invalid_request_error"}}\n\ndata: [DONE]\n\n', "ok"),
])
def test_replies_are_classified(status, content_type, raw, kind):
    assert classify(status, content_type, raw).kind == kind


def test_new_tracebacks_are_found_in_a_log(tmp_path):
    log = tmp_path / "service.log"
    log.write_text('INFO started\nTraceback (most recent call last):\n  File "/x/old.py", line 1, in f\nKeyError: 1\n')
    watch = LogWatch(log)
    watch.skip()
    with log.open("a") as out:
        out.write('ERROR failed\nTraceback (most recent call last):\n  File "/app/gateway/call.py", line 9, in run\n'
                  '    body = parse()\n  File "/venv/lib/python3.11/site-packages/lib.py", line 3, in parse\n'
                  "    raise ValueError\nValueError: bad \\ud800\nINFO next\n")
    ((key, text),) = watch.tracebacks()
    assert key == "ValueError in call.py:run"
    assert text.endswith("ValueError: bad \\ud800")
    assert watch.tracebacks() == []
