"""kvrelay/json_codec.py reads as json.loads reads, and writes what json.loads reads back."""

from __future__ import annotations

import json
import math
import random
import struct
from typing import Any

import pytest

from kvrelay import json_codec


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (1 and 1.0 differ; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _float_literals(rng: random.Random, n: int) -> list[str]:
    literals = []
    for _ in range(n):
        pick = rng.random()
        if pick < 0.4:  # any finite double, as Python spells it
            value = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
            literals.append(repr(value) if math.isfinite(value) else "0.5")
        elif pick < 0.7:  # long mantissas and exponents near the ends of the range
            literals.append(f"{rng.randrange(10**rng.randint(1, 25))}.{rng.randrange(10**rng.randint(1, 25))}"
                            f"e{rng.randint(-330, 310)}")
        else:  # more digits than a double holds
            whole = str(rng.randrange(1, 10**rng.randint(1, 30)))
            literals.append(f"{whole}.{rng.randrange(10**rng.randint(1, 40))}")
    return literals


def test_floats_parse_to_the_same_double_as_json() -> None:
    for literal in _float_literals(random.Random(7), 20000):
        assert _same(json_codec.loads(literal), json.loads(literal)), literal


@pytest.mark.parametrize("text", [
    b'{"a":1,"a":2}',  # the last duplicate key wins
    b'{"a":"\\ud800"}',  # a lone surrogate's escape: refused by pydantic-core, read by json
    b'{"a":NaN,"b":-Infinity,"c":1e400}',
    b'{"a":123456789012345678901234567890,"b":-0.0,"c":1.0,"d":1}',
    b"[" * 300 + b"]" * 300,  # past pydantic-core's nesting limit
    b'\xef\xbb\xbf{"a":1}',  # a byte-order mark
    '{"a":"\u00e9\\u00e9","b":"\\n\\t\\"\\\\\\/"}'.encode(),
    b' {"a" : [1 , 2] } ',
])
def test_values_are_json_loads_values(text: bytes) -> None:
    assert _same(json_codec.loads(text), json.loads(text))
    assert _same(json_codec.loads(text.decode("utf-8-sig")), json.loads(text.decode("utf-8-sig")))


@pytest.mark.parametrize("text", [b'{"a":1} x', b'{"a":"\x01"}', b"", b"{", b"\xff", b"[" * 100_000])
def test_what_json_refuses_is_refused_with_its_error(text: bytes) -> None:
    try:
        json.loads(text)
    except (ValueError, RecursionError) as exc:
        expected: type[BaseException] = type(exc)
    with pytest.raises(expected):
        json_codec.loads(text)


def test_dumps_is_compact_utf8_that_reads_back_the_same() -> None:
    value = {"model": "m", "messages": [{"role": "user", "content": "é\n\u2028\x00\x7f/\"\\ 😀"}],
             "n": [0, -1, 2**63 - 1, 0.1, 1e-7, 2.5e300, True, False, None], "nested": {"k": []}}
    written = json_codec.dumps(value)
    assert _same(json.loads(written), value)
    assert b" " not in written.replace(" 😀".encode(), b"")  # compact: no space but the one in the text
    assert "é".encode() in written  # UTF-8, not \\u escapes
    assert json_codec.dumps_text(value) == written.decode()
    assert json_codec.dumps_text({"a": "é", "b": [1, "x"]}) == \
        json.dumps({"a": "é", "b": [1, "x"]}, separators=(",", ":"), ensure_ascii=False)


def test_dumps_refuses_what_json_cannot_write_with_a_type_error() -> None:
    with pytest.raises(TypeError):
        json_codec.dumps({"a": object()})


def test_a_lone_surrogate_is_written_escaped_as_json_writes_it() -> None:
    """An upstream's event may hold one (the final chunk is re-encoded without the engine's
    reports): it is written, not refused, and reads back the same."""
    value = {"text": "a\ud800b", "n": 1}
    written = json_codec.dumps(value)
    assert written == json.dumps(value, separators=(",", ":")).encode() == b'{"text":"a\\ud800b","n":1}'
    assert json_codec.loads(written) == value
    assert json_codec.dumps_text(value) == written.decode()
