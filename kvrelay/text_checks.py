"""Text that cannot travel: strings JSON allows but UTF-8 cannot encode.

JSON's `\\ud800` escape decodes to a lone surrogate, a Python `str` that has no UTF-8
form. Such a string breaks everything downstream that encodes text: the tokenizer,
hashing, SQL, OpenTelemetry, Prometheus and the JSON of a response. Both the gateway
and the engine refuse it at the door, naming the field, so it never gets that far.

Shared by the gateway and the engine; torch-free.
"""

from __future__ import annotations

from typing import Any, NamedTuple

def encodable(text: str) -> bool:
    """True when `text` has a UTF-8 form (no lone surrogate)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def first_unencodable(value: Any, root: str = "") -> str | None:
    """The path (`messages[0].content`, `tools[1].function.name`, `metadata.<key>` for a
    bad key) of the first string inside a parsed JSON value that UTF-8 cannot encode;
    None when every string, keys included, can. Iterative, so nesting costs no stack;
    linear in the size of the value (a path is spelt out only for the culprit)."""
    # Each entry: (value, its parent's link, its own label); links chain up to the root.
    stack: list[tuple[Any, _Link | None, str]] = [(value, None, root)]
    while stack:
        item, parent, label = stack.pop()
        if isinstance(item, str):
            if not encodable(item):
                return _spell(_Link(parent, label)) or "body"
        elif isinstance(item, dict):
            link = _Link(parent, label)
            children = []
            for key, child in item.items():
                key_text = key if isinstance(key, str) else str(key)
                if not encodable(key_text):
                    return _spell(_Link(link, ".<key>")).lstrip(".")
                children.append((child, link, "." + key_text))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            link = _Link(parent, label)
            stack.extend((child, link, f"[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


class _Link(NamedTuple):
    parent: _Link | None
    label: str


def _spell(link: _Link | None) -> str:
    labels = []
    while link is not None:
        labels.append(link.label)
        link = link.parent
    return "".join(reversed(labels)).lstrip(".")


UNENCODABLE = "the text is not valid Unicode (a lone surrogate such as \\ud800); it cannot be encoded as UTF-8"


def describe(path: str) -> str:
    """The error message for an unencodable string at `path`."""
    return f"{path}: {UNENCODABLE}"
