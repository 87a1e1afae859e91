"""body_misfit skips the walk only where first_misfit would find nothing: checked against
it on generated bodies in every encoding json.loads reads, with the values that misfit
(lone surrogates, ints past int64, NaN, Infinity, overflowing floats) mixed in."""

from __future__ import annotations

import json

import hypothesis
from hypothesis import strategies as st

from kvrelay.json_values import INT64_MAX, body_misfit, first_misfit

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6)
           | st.sampled_from(["\ud800", "x\udfff", "1e5", "NaN", 1e308, INT64_MAX, INT64_MAX + 1, -2**63 - 1]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4) | st.just(
    "\udc00"), inner, max_size=3), max_leaves=10)
encodings = st.sampled_from(["ascii-json", "utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"])


def encode(value: object, encoding: str) -> bytes:
    if encoding == "ascii-json":
        return json.dumps(value).encode()  # \\uXXXX escapes, NaN and Infinity literals
    return json.dumps(value, ensure_ascii=False).encode(encoding, "surrogatepass")


@hypothesis.given(value=values, encoding=encodings)
@hypothesis.settings(max_examples=600, deadline=None, database=None)
def test_body_misfit_is_first_misfit(value, encoding):
    raw = encode(value, encoding)
    body = json.loads(raw)
    assert body_misfit(raw, body) == first_misfit(body)


def test_literals_that_misfit_without_a_flagged_value():
    for raw in [b'{"a": 1e400}', b'{"a": -1E400}', b'{"a": ' + b"9" * 400 + b'.0}', b'{"a": 9223372036854775808}',
                b'{"a": "\\ud800"}', b'{"\\uDFFF": 1}', b'{"a": NaN}', b'{"a": -Infinity}']:
        body = json.loads(raw)
        assert first_misfit(body) is not None and body_misfit(raw, body) == first_misfit(body), raw
