"""PrefixLocator: how many whole blocks of a prompt lie inside the plan's fixed prefix.

The plan speaks in characters of the request's messages; vLLM hands the connector token
ids after the chat template. The locator decodes the prompt, finds the fixed prefix's
text by its content hash (the plan's sha256) at a line start (chat templates put a
message's content right after a newline; the prompt's first character also counts), and
then takes blocks while the decoded text of the prompt's first blocks still ends within
the prefix. Decoding a token prefix never depends on what follows it, so this holds
however the rest of the prompt was tokenized. When the text is not found the answer is
0: the connector then keeps nothing for that request rather than guess.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from kvrelay.wire.plan import Segment


class Tokenizer(Protocol):
    """What the locator needs of a Hugging Face tokenizer."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class PrefixLocator:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def num_prefix_blocks(self, token_ids: list[int], segment: Segment, block_size: int) -> int:
        """Leading whole blocks whose text ends within the fixed prefix segment."""
        text = self._decode(token_ids)
        end = _find(text, segment.char_end - segment.char_start, segment.content_hash)
        if end is None:
            return 0
        num_blocks = 0
        for num in range(1, len(token_ids) // block_size + 1):
            head = self._decode(token_ids[:num * block_size])
            if len(head) > end or not text.startswith(head):  # past the prefix, or cut inside a character
                break
            num_blocks = num
        return num_blocks

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


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
