"""Delimited blocks: explicit markers that split a message into reusable pieces.

`<TTSEP>` (TokenDance) separates blocks; `<kv_start>` ... `<kv_end>` (KVLink) encloses
one; users can add their own separators. The markers stay where they are in the text:
a block is the span between them, so the plan's offsets still index the original
message.
"""

from __future__ import annotations

from typing import NamedTuple

TTSEP = "<TTSEP>"
KV_START, KV_END = "<kv_start>", "<kv_end>"


class Block(NamedTuple):
    start: int
    end: int


def split_blocks(text: str, separators: tuple[str, ...] = (TTSEP,)) -> list[Block]:
    """The delimited blocks of `text` (stripped of surrounding whitespace); empty when the
    text has no delimiter at all, since a message without markers is not split."""
    cuts: list[tuple[int, int]] = []  # (marker start, marker end)
    for marker in (*separators, KV_START, KV_END):
        at = text.find(marker)
        while at >= 0:
            cuts.append((at, at + len(marker)))
            at = text.find(marker, at + len(marker))
    if not cuts:
        return []
    cuts.sort()
    blocks: list[Block] = []
    start = 0
    for cut_start, cut_end in [*cuts, (len(text), len(text))]:
        block = _strip(text, start, cut_start)
        if block is not None:
            blocks.append(block)
        start = max(start, cut_end)
    return blocks


def _strip(text: str, start: int, end: int) -> Block | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return Block(start, end) if end > start else None
