"""Column types that store any Python string a request can bring.

A request can carry text that a database refuses: PostgreSQL rejects NUL in text, a lone
surrogate has no UTF-8 form at all, and a value longer than its VARCHAR is an error. One
such value used to fail its whole batch of records. These types make every string
storable at the boundary: NUL and lone surrogates become U+FFFD and a string is cut to
its column's length. The loss is in the stored copy only (hashes and lengths are taken
from the original), and it is the same for a value written and a value looked up, so
queries by id still match.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import String, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

from kvrelay.json_values import encodable

_REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(text: str, max_chars: int | None = None) -> str:
    """`text` as every database stores it: no NUL, no lone surrogate, at most `max_chars`."""
    if "\x00" in text:
        text = text.replace("\x00", _REPLACEMENT)
    if not encodable(text):
        text = _SURROGATE.sub(_REPLACEMENT, text)
    return text if max_chars is None else text[:max_chars]


class StorableString(TypeDecorator[str]):
    """VARCHAR(n) that takes any string (see the module docstring)."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if not isinstance(value, str):
            return value
        impl = self.impl  # the String instance TypeDecorator made of the class above
        return storable(value, impl.length if isinstance(impl, String) else None)


class StorableText(TypeDecorator[str]):
    """TEXT that takes any string (see the module docstring)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return storable(value) if isinstance(value, str) else value
