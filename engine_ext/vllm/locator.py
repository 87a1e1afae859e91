"""PrefixLocator: how many of a prompt's tokens the plan's fixed prefix covers.

The plan speaks in characters of the request's messages; vLLM hands the connector token
ids after the chat template. The locator decodes the prompt, finds the fixed prefix's
text by its content hash (the plan's sha256) at a line start (chat templates put a
message's content right after a newline; the prompt's first character also counts), and
maps its end to a token count through the tokenizer's offsets. When the prompt does not
re-tokenize to the same ids, or the text is not found, it answers None: the connector
then keeps nothing for that request rather than guess.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

from engine_ext.protocol import Segment


class Tokenizer(Protocol):
    """What the locator needs of a Hugging Face fast tokenizer."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def __call__(self, text: str, add_special_tokens: bool = ..., return_offsets_mapping: bool = ...) -> Any: ...


class PrefixLocator:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def num_prefix_tokens(self, token_ids: list[int], segment: Segment) -> int | None:
        """The number of leading tokens whose text ends within the fixed prefix segment."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded["input_ids"]) != list(token_ids):
            return None
        end = _find(text, segment.char_end - segment.char_start, segment.content_hash)
        if end is None:
            return None
        num_tokens = 0
        for _, token_end in encoded["offset_mapping"]:
            if token_end > end:
                break
            num_tokens += 1
        return num_tokens


def _find(text: str, length: int, content_hash: str) -> int | None:
    """The end of the first line-start match of the text with this sha256, or None."""
    start = 0
    while start + length <= len(text):
        if hashlib.sha256(text[start:start + length].encode()).hexdigest() == content_hash:
            return start + length
        newline = text.find("\n", start)
        if newline < 0:
            return None
        start = newline + 1
    return None
