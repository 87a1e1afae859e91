"""Which tokens of a finished answer are its text, so the answer can be kept for reuse.

The next agent's prompt quotes an answer's text, so the answer is worth keeping as a
segment (engine_ext/kv/segment_index.py) only as the tokens that make exactly that
text. How it ended decides which those are:

- on a stop token (EOS or `stop_token_ids`): every token before it. The stop token is
  not text, and its KV was never computed, nor needed.
- by length: every token. The last one was sampled but never run through the model,
  so its KV must be computed before the answer is kept (the engine runs that one row).
- on a stop string: the text ends just before the string, which may fall inside a
  token; the answer is kept only when some whole number of tokens decodes to exactly
  the text the client got, and then as those tokens.
"""

from __future__ import annotations

from typing import Literal, Protocol

Ending = Literal["stop_token", "length", "stop_string"]


class _Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


def answer_tokens(output_ids: list[int], text: str, ending: Ending, decoder: _Decoder) -> int:
    """How many of `output_ids` (from the first) make exactly `text`, the answer the
    client got; 0 when no whole number of tokens does."""
    if ending == "stop_token":
        return len(output_ids) - 1
    if ending == "length":
        return len(output_ids) if decoder.decode(output_ids) == text else 0
    # A stop string: the tokens before the one that completed it, or fewer.
    for count in range(len(output_ids) - 1, 0, -1):
        decoded = decoder.decode(output_ids[:count])
        if decoded == text:
            return count
        if len(decoded) < len(text):
            return 0  # shorter still from here on: the text ends inside a token
    return 0
