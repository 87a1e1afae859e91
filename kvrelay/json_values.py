"""Values a parsed JSON body can hold but the stack cannot: unencodable text, unbounded
integers, and the NaN and Infinity that Python's json reads though JSON has neither.

JSON's `\\ud800` escape decodes to a lone surrogate, a Python `str` that has no UTF-8
form; such a string breaks everything downstream that encodes text (the tokenizer,
hashing, SQL, OpenTelemetry, Prometheus, the JSON of a response). JSON integers are
unbounded, and every engine computes with int64 at most (a seed of 2**70 once killed
the engine thread). NaN echoed back in kv_transfer_params made a response that could
not be written (a 500). Both the gateway and the engine refuse such values at the door,
naming the field, so they never get further.

Shared by the gateway and the engine; torch-free.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UNENCODABLE = "the text is not valid Unicode (a lone surrogate such as \\ud800); it cannot be encoded as UTF-8"
UNBOUNDED = f"the integer is outside the 64-bit range [{INT64_MIN}, {INT64_MAX}]"
NONFINITE = "NaN and Infinity are not JSON numbers"


class Misfit(NamedTuple):
    path: str  # `messages[0].content`, `tools[1].function.name`, `metadata.<key>` for a key
    reason: str

    @property
    def message(self) -> str:
        return f"{self.path}: {self.reason}"


def encodable(text: str) -> bool:
    """True when `text` has a UTF-8 form (no lone surrogate)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def first_misfit(value: Any, root: str = "") -> Misfit | None:
    """The first string (keys included) that UTF-8 cannot encode, integer outside int64,
    or NaN or infinite float inside a parsed JSON value; None when there is none. Iterative, so nesting
    costs no stack; linear in the size of the value (a path is spelt out only for the
    culprit)."""
    # Each entry: (value, its parent's link, its own label); links chain up to the root.
    stack: list[tuple[Any, _Link | None, str]] = [(value, None, root)]
    while stack:
        item, parent, label = stack.pop()
        if isinstance(item, str):
            if not encodable(item):
                return Misfit(_spell(_Link(parent, label)) or "body", UNENCODABLE)
        elif isinstance(item, int) and not isinstance(item, bool):
            if not INT64_MIN <= item <= INT64_MAX:
                return Misfit(_spell(_Link(parent, label)) or "body", UNBOUNDED)
        elif isinstance(item, float):
            if not math.isfinite(item):  # Python's json reads them; no response could carry them back
                return Misfit(_spell(_Link(parent, label)) or "body", NONFINITE)
        elif isinstance(item, dict):
            link = _Link(parent, label)
            children = []
            for key, child in item.items():
                key_text = key if isinstance(key, str) else str(key)
                if not encodable(key_text):
                    return Misfit(_spell(_Link(link, ".<key>")), UNENCODABLE)
                children.append((child, link, "." + key_text))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            link = _Link(parent, label)
            stack.extend((child, link, f"[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


# What a raw ASCII body needs to hold a misfit: a surrogate's escape, NaN or Infinity, an
# exponent (how a short float literal overflows) or 19 digits in a row (an int past int64,
# or a float literal long enough to overflow). Found inside a string, it only costs the
# walk. A NUL is never in UTF-8 JSON; it is in UTF-16 and UTF-32, which json.loads also
# reads and where these patterns are spelt otherwise.
_MAYBE_MISFIT = re.compile(rb"NaN|Infinity|\\u[dD][89a-fA-F]|[0-9][eE]|[0-9]{19}|\x00")


def body_misfit(raw: bytes, body: Any) -> Misfit | None:
    """first_misfit(body) for `body = json.loads(raw)`, without walking the body when its
    raw text cannot hold one (one C scan of the bytes; the walk is a Python loop over
    every value, on every request). ASCII text makes every string ASCII but for its
    escapes, so a lone surrogate needs a `\\uD800`-`\\uDFFF` escape."""
    if raw.isascii() and _MAYBE_MISFIT.search(raw) is None:
        return None
    return first_misfit(body)


class _Link(NamedTuple):
    parent: _Link | None
    label: str


def _spell(link: _Link | None) -> str:
    labels = []
    while link is not None:
        labels.append(link.label)
        link = link.parent
    return "".join(reversed(labels)).lstrip(".")
