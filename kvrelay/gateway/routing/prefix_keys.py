"""Prefix keys: names for the prefixes of a prompt that the gateway can compute without a
tokenizer, so that what an engine reported about one prompt's blocks can be found again
for a later prompt that starts the same way.

A chat prompt's keys chain over its messages: key i covers messages 0..i, so an agent's
next turn (its earlier messages, then the answer and a new message) finds its previous
turn's key, and every agent that starts from the same system message finds that key.
A completion prompt's keys chain over fixed-size chunks of its text. The chain starts
from what else shapes the rendered prompt (the model, the tools, the tenant's cache
salt), so two tenants' prompts never share a key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

TEXT_CHUNK_CHARS = 1024  # a completion prompt's keys: one per this many characters
MAX_KEYS = 512  # a longer conversation keys its last messages by their position in this many


class PrefixKey(NamedTuple):
    key: bytes
    chars: int  # characters of the prompt this prefix covers (a share of its tokens)


def prefix_keys(view: dict[str, Any], cache_salt: str | None) -> list[PrefixKey]:
    """The keys of the prompt in a chat-shaped or completion body, shortest prefix first;
    empty when the body has no prompt the gateway can read."""
    root = _hash(b"", _canonical({"model": view.get("model"), "tools": view.get("tools"), "salt": cache_salt}))
    messages = view.get("messages")
    if isinstance(messages, list):
        return _chain(root, [_canonical(m) for m in messages])
    prompt = view.get("prompt")
    if isinstance(prompt, str):
        data = prompt.encode()
        return _chain(root, [data[i:i + TEXT_CHUNK_CHARS] for i in range(0, len(data), TEXT_CHUNK_CHARS)])
    return []


def _chain(root: bytes, parts: list[bytes]) -> list[PrefixKey]:
    keys: list[PrefixKey] = []
    key, chars = root, 0
    for part in parts:
        key, chars = _hash(key, part), chars + len(part)
        keys.append(PrefixKey(key, chars))
    if len(keys) > MAX_KEYS:  # keep the first and the last: a new turn matches near its end
        keys = keys[: MAX_KEYS // 2] + keys[-MAX_KEYS // 2:]
    return keys


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def _hash(parent: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(parent + data, digest_size=16).digest()
