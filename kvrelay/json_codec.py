"""JSON on the request path, through pydantic-core's Rust codec, read as Python's json reads.

The gateway parses and writes JSON several times per request (the client's body, the
upstream body with its plan, the plan's text for the record, the stream's events, the
state rows): about a tenth of its one core under load with the standard library's codec.
pydantic-core's `from_json` and `to_json` do the same work in a third of the time or less.

`loads` gives exactly what `json.loads` gives. Where both succeed they build equal
values (floats included: both round correctly, checked on random literals in
tests/kvrelay/test_json_codec.py). Where `from_json` refuses a text, `json.loads` has
the last word, so the answer and the error stay the standard library's: a lone
surrogate's escape (`"\\ud800"`, which json reads and json_values refuses later, naming
the field), nesting past pydantic-core's 200 levels, a UTF-8 byte-order mark, and every
text that is not JSON at all.

`dumps` writes compact JSON as UTF-8 bytes, non-ASCII text unescaped. A reader gets the
same values as from `json.dumps(value, separators=(",", ":"))`; only the spelling of some
floats (`1e-7` for `1e-07`) and of non-ASCII text differs. NaN and Infinity are written
as Python's json writes them, though the gateway refuses them in bodies before this
point; a string with a lone surrogate (no UTF-8 form) with `json.dumps`'s escapes.
Shared by the gateway and the engine; torch-free.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import from_json, to_json


def loads(data: bytes | str) -> Any:
    """json.loads(data), parsed by pydantic-core where it can (see the module's docstring)."""
    try:
        return from_json(data)
    except ValueError:
        return json.loads(data)


def dumps(value: Any) -> bytes:
    """Compact JSON, UTF-8; raises TypeError for a value that JSON has no form for.

    A string with a lone surrogate has no UTF-8 form: pydantic-core refuses it, and the
    value is written by `json.dumps` with `\\u` escapes, as before (an upstream's event
    may hold one; the client's body never does, json_values refuses it at the door)."""
    try:
        return to_json(value, inf_nan_mode="constants")
    except ValueError:  # PydanticSerializationError; json.dumps raises TypeError where no JSON form exists
        return json.dumps(value, separators=(",", ":")).encode()


def dumps_text(value: Any) -> str:
    """dumps() as text: `json.dumps(value, separators=(",", ":"), ensure_ascii=False)`."""
    return dumps(value).decode()
