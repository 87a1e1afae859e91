"""Segment-aligned tokenization: a SegmentPlan's character segments as token ranges.

Reusing a segment's KV across requests needs two things: the same text must give the
same token ids wherever it appears, and the engine must know where those ids sit in
the prompt. Tokenizing the whole rendered prompt at once gives neither (BPE merges
across the edge of a segment, so its tokens depend on its neighbours). So the rendered
prompt is cut at every segment boundary and at the edges of each planned message, and
each piece is tokenized alone: a segment's ids then depend only on its own text.

Where a message's content sits in the rendered prompt is found by rendering the chat
template a second time with sentinel strings in place of the planned contents. A
template that drops, repeats or transforms content (e.g. strips it) defeats this; the
prompt is then tokenized whole, with no segments, and the note says why.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, NamedTuple

from engine_ext.errors import InvalidRequestError
from engine_ext.protocol import Segment, SegmentPlan
from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.tokenizer import Tokenizer

_OUT_OF_RANGE = "no such message"
_BEYOND_CONTENT = "char range beyond the message"
_HASH_MISMATCH = "content differs from the plan"

Piece = tuple[str, int | None]  # text, and the plan index of the segment it is (None: none)
Layout = list[str | int]  # rendered order: template text (str) or a planned message's index


class AlignedPrompt(NamedTuple):
    token_ids: list[int]
    segments: list[TokenSegment]  # one per placed plan segment, by position in the prompt
    note: str | None = None  # why alignment was partial or skipped; None when complete
    scope: ReuseScope | None = None  # the plan's app and agent


class _Misaligned(Exception):
    """The template's output cannot be cut at message contents."""


def _sentinel(index: int) -> str:
    # Private-use characters: no real text or template contains them.
    return f"\U000f8a11{index}\U000f8a12"


def _content_text(content: Any) -> str:
    """Content as one string, as ChatMessage.to_template makes it."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check(seg: Segment, contents: list[str]) -> str | None:
    """Why a plan segment cannot be placed, or None if it can."""
    if seg.message_index >= len(contents):
        return _OUT_OF_RANGE
    content = contents[seg.message_index]
    if seg.char_end > len(content):
        return _BEYOND_CONTENT
    if _sha256(content[seg.char_start:seg.char_end]) != seg.content_hash:
        return _HASH_MISMATCH
    return None


def _splits_cleanly(tok: Tokenizer) -> bool:
    """Whether pieces tokenized apart decode to their concatenation. Not so for tokenizers
    that prefix every call's text (SentencePiece's Metaspace, add_prefix_space=True)."""
    pieces = ["ab", "cd", " e"]
    ids = [i for piece in pieces for i in tok.encode(piece)]
    return tok.decode(ids, skip_special_tokens=False) == "".join(pieces)


def _skip_note(skipped: Counter[str], total: int) -> str | None:
    if not skipped:
        return None
    count = sum(skipped.values())
    if len(skipped) == 1:
        return f"{count} of {total} segments skipped: {next(iter(skipped))}"
    reasons = ", ".join(f"{reason} ({n})" for reason, n in skipped.most_common())
    return f"{count} of {total} segments skipped: {reasons}"


def _join_notes(*notes: str | None) -> str | None:
    present = [n for n in notes if n]
    return "; ".join(present) if present else None


def _message_pieces(content: str, placed: list[tuple[int, Segment]]) -> list[Piece]:
    """A message's content cut at its placed segments; uncovered text is its own piece."""
    pieces: list[Piece] = []
    cursor = 0
    for plan_index, seg in placed:
        if seg.char_start > cursor:
            pieces.append((content[cursor:seg.char_start], None))
        pieces.append((content[seg.char_start:seg.char_end], plan_index))
        cursor = seg.char_end
    if cursor < len(content):
        pieces.append((content[cursor:], None))
    return pieces


class PromptAligner:
    """Tokenizes prompts segment-aligned against a SegmentPlan."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._splits_cleanly = _splits_cleanly(tokenizer)

    def chat(self, messages: list[dict], tools: list[dict] | None, plan: SegmentPlan) -> AlignedPrompt:
        messages = [{**m, "content": _content_text(m.get("content"))} for m in messages]
        contents = [m["content"] for m in messages]
        real = self._tok.render_chat(messages, tools=tools)
        by_message, skip_note = self._placeable(plan, contents)
        try:
            self._check_tokenizer(by_message)
            layout = self._layout(messages, tools, sorted(by_message), real)
        except _Misaligned as exc:
            return self._whole(real, exc, skip_note)
        return self._assemble(layout, contents, by_message, plan, skip_note)

    def text(self, prompt: str, plan: SegmentPlan) -> AlignedPrompt:
        by_message, skip_note = self._placeable(plan, [prompt])
        try:
            self._check_tokenizer(by_message)
        except _Misaligned as exc:
            return self._whole(prompt, exc, skip_note)
        return self._assemble([0], [prompt], by_message, plan, skip_note)

    def _whole(self, text: str, why: _Misaligned, skip_note: str | None) -> AlignedPrompt:
        note = f"segments not placed, prompt tokenized whole: {why}"
        return AlignedPrompt(self._tok.encode(text), [], _join_notes(note, skip_note))

    def _check_tokenizer(self, by_message: dict[int, list[tuple[int, Segment]]]) -> None:
        if by_message and not self._splits_cleanly:
            raise _Misaligned("the tokenizer changes text tokenized in pieces (e.g. adds a prefix space)")

    @staticmethod
    def _placeable(plan: SegmentPlan, contents: list[str]
                   ) -> tuple[dict[int, list[tuple[int, Segment]]], str | None]:
        """The plan segments that can be placed, by message, and a note on the others."""
        by_message: dict[int, list[tuple[int, Segment]]] = {}
        skipped: Counter[str] = Counter()
        for plan_index, seg in enumerate(plan.segments):
            reason = _check(seg, contents)
            if reason is None:
                by_message.setdefault(seg.message_index, []).append((plan_index, seg))
            else:
                skipped[reason] += 1
        return by_message, _skip_note(skipped, len(plan.segments))

    def _layout(self, messages: list[dict], tools: list[dict] | None, planned: list[int], real: str) -> Layout:
        """The rendered prompt as template text and planned message contents, in order."""
        if not planned:
            return [real]
        wanted = set(planned)
        marked = [{**m, "content": _sentinel(i)} if i in wanted else m for i, m in enumerate(messages)]
        try:
            rendered = self._tok.render_chat(marked, tools=tools)
        except InvalidRequestError as exc:
            raise _Misaligned(f"the chat template rejected placeholder contents ({exc})") from exc
        found: list[tuple[int, int]] = []  # (position in rendered, message index)
        for i in planned:
            count = rendered.count(_sentinel(i))
            if count != 1:
                raise _Misaligned(f"the chat template renders message {i}'s content {count} times")
            found.append((rendered.index(_sentinel(i)), i))
        layout: Layout = []
        cursor = 0
        for position, i in sorted(found):
            layout += [rendered[cursor:position], i]
            cursor = position + len(_sentinel(i))
        layout.append(rendered[cursor:])
        rebuilt = "".join(part if isinstance(part, str) else messages[part]["content"] for part in layout)
        if rebuilt != real:
            raise _Misaligned("the chat template transforms message content")
        return layout

    def _assemble(self, layout: Layout, contents: list[str], by_message: dict[int, list[tuple[int, Segment]]],
                  plan: SegmentPlan, skip_note: str | None) -> AlignedPrompt:
        pieces: list[Piece] = []
        for part in layout:
            if isinstance(part, str):
                pieces.append((part, None))
            else:
                pieces += _message_pieces(contents[part], by_message.get(part, []))
        token_ids: list[int] = []
        segments: list[TokenSegment] = []
        for text, plan_index in pieces:
            if not text:
                continue
            start = len(token_ids)
            token_ids += self._tok.encode(text)
            if plan_index is not None and len(token_ids) > start:
                seg = plan.segments[plan_index]
                segments.append(TokenSegment(start, len(token_ids), seg.kind, seg.name,
                                             getattr(seg, "method", None), plan_index))
        return AlignedPrompt(token_ids, segments, skip_note)
