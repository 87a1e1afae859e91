"""Canonical tokenization with a SegmentPlan's character segments as token ranges.

A plan must never change the tokens a prompt runs on: the answer to a request with a
plan has to be the answer to the same request without one. So the rendered prompt is
always tokenized whole, exactly as without a plan, and each planned segment is mapped
onto those canonical ids through the tokens' character offsets. A segment whose edge
falls inside a token (BPE merged it with its neighbour, e.g. " The" across the space
of "klaus: The weather") cannot be placed as it is: a reusable one is trimmed inward
to the tokens wholly inside it (a private one is computed anyway), and the straddling
token is computed with the text around it. An answer quoted inline after a name loses
its first word this way; the index finds the rest as the tail of the answer it holds
(SegmentIndex.lookup). A segment with no whole token inside is not placed, and the
note counts both. Reuse then looks a segment up by its canonical ids, so the same
text placed in two contexts is reused only where both tokenized it alike.

Where a message's content sits in the rendered prompt is found by rendering the chat
template a second time with sentinel strings in place of the planned contents. A
template that drops, repeats or transforms content (e.g. strips it) defeats this; the
prompt then runs with no segments, and the note says why.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import Counter
from typing import Any, NamedTuple

from engine_ext.errors import InvalidRequestError
from kvrelay.wire.plan import Segment, SegmentPlan
from engine_ext.reuse.segments import REUSABLE_KINDS, ReuseScope, TokenSegment
from engine_ext.tokenizer import Tokenizer

_OUT_OF_RANGE = "no such message"
_BEYOND_CONTENT = "char range beyond the message"
_HASH_MISMATCH = "content differs from the plan"
_INSIDE_TOKEN = "an edge falls inside a token"
_TRIMMED = "trimmed to the whole tokens inside them (an edge fell inside a token)"

Piece = tuple[str, int | None]  # text, and the plan index of the segment it is (None: none)
Offsets = list[tuple[int, int]]  # each token's character span in the text
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


def token_edges(offsets: Offsets, text_length: int) -> dict[int, int]:
    """Character position -> token index, for every position where the tokens split the
    text cleanly: every token before it ends at or before it, every token from it on
    starts at or after it, and it is exactly an end and a start. A position inside a
    token, or inside a character that several byte tokens share, is not an edge."""
    n = len(offsets)
    edges: dict[int, int] = {}
    latest_end = 0  # the furthest end of the tokens before i
    earliest_start = [text_length] * (n + 1)  # the earliest start of tokens i..n-1
    for i in range(n - 1, -1, -1):
        earliest_start[i] = min(offsets[i][0], earliest_start[i + 1])
    for i in range(n + 1):
        if i == n or offsets[i][0] == latest_end:
            here = text_length if i == n else offsets[i][0]
            if latest_end == here == earliest_start[i]:
                edges.setdefault(here, i)
        if i < n:
            latest_end = max(latest_end, offsets[i][1])
    return edges


class PromptAligner:
    """Tokenizes prompts canonically and maps a SegmentPlan's segments onto the tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
             plan: SegmentPlan) -> AlignedPrompt:
        messages = [{**m, "content": _content_text(m.get("content"))} for m in messages]
        contents = [m["content"] for m in messages]
        real = self._tok.render_chat(messages, tools=tools)
        by_message, skip_note = self._placeable(plan, contents)
        try:
            layout = self._layout(messages, tools, sorted(by_message), real)
        except _Misaligned as exc:
            return self._whole(real, exc, skip_note)
        return self._assemble(layout, contents, by_message, plan, skip_note)

    def text(self, prompt: str, plan: SegmentPlan) -> AlignedPrompt:
        by_message, skip_note = self._placeable(plan, [prompt])
        return self._assemble([0], [prompt], by_message, plan, skip_note)

    def _whole(self, text: str, why: _Misaligned, skip_note: str | None) -> AlignedPrompt:
        note = f"segments not placed: {why}"
        return AlignedPrompt(self._tok.encode(text), [], _join_notes(note, skip_note))

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

    def _layout(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, planned: list[int],
                real: str) -> Layout:
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
        text = "".join(piece for piece, _ in pieces)
        token_ids, offsets = self._tok.encode_with_offsets(text)
        edges = token_edges(offsets, len(text))
        positions = sorted(edges)
        segments: list[TokenSegment] = []
        inside = trimmed = 0
        cursor = 0
        for piece, plan_index in pieces:
            char_start, cursor = cursor, cursor + len(piece)
            if plan_index is None or not piece:
                continue
            seg = plan.segments[plan_index]
            start, end = edges.get(char_start), edges.get(cursor)
            if start is None or end is None:
                if seg.kind in REUSABLE_KINDS:  # a private segment is computed either way
                    start, end = _inward(edges, positions, char_start, cursor)
                if start is None or end is None or end <= start:
                    inside += 1
                    continue
                trimmed += 1
            if end > start:
                segments.append(TokenSegment(start, end, seg.kind, seg.name, seg.method, plan_index))
        total = len(plan.segments)
        inside_note = f"{inside} of {total} segments not placed: {_INSIDE_TOKEN}" if inside else None
        trimmed_note = f"{trimmed} of {total} segments {_TRIMMED}" if trimmed else None
        return AlignedPrompt(token_ids, segments, _join_notes(skip_note, inside_note, trimmed_note))


def _inward(edges: dict[int, int], positions: list[int], char_start: int, char_end: int) -> tuple[int, int]:
    """The token range wholly inside [char_start, char_end): from the first edge at or
    after its start to the last at or before its end (empty when no token fits)."""
    first = bisect.bisect_left(positions, char_start)
    last = bisect.bisect_right(positions, char_end) - 1
    if first >= len(positions) or last < 0 or positions[first] >= positions[last]:
        return 0, 0
    return edges[positions[first]], edges[positions[last]]
