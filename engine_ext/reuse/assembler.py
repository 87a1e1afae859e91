"""Assembler: decides, segment by segment, where a prompt's KV comes from.

Given the tokens the prefix cache already covers, each remaining segment of the plan is
either placed (its cached KV copied in at its new position, by shift, blend or link)
or computed densely, with the reason. The guard lives here: a segment is placed only
when the segment index holds exactly its tokens; anything else is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine_ext.config import ReuseConfig
from engine_ext.kv.segment_index import SegmentEntry, SegmentIndex
from engine_ext.reuse.segments import ReuseMethod, SegmentOutcome, TokenSegment


class PlacedSegment(NamedTuple):
    segment: TokenSegment
    method: ReuseMethod  # shift | blend | link
    entry: SegmentEntry
    num_linked: int  # tokens at its start recomputed in every layer (link; the last prompt token)


@dataclass
class Assembly:
    """One prompt's reuse decisions, then (after the prefill) what blend selected."""

    num_tokens: int  # tokens of the sequence (prompt, plus output after a preemption)
    num_prefix_tokens: int  # served by the prefix cache
    placed: list[PlacedSegment]
    dense: list[SegmentOutcome]  # outcomes of segments not placed
    num_selected: dict[int, int] = field(default_factory=dict)  # placed index -> blend rows kept
    pinned: bool = True  # the placed entries' blocks are held until the assembler releases them

    @property
    def first_approximate(self) -> int | None:
        """Position of the first token whose KV is not exact, or None."""
        return min((p.segment.start for p in self.placed), default=None)

    def full_positions(self) -> torch.Tensor:
        """Positions computed in every layer: all that no placed segment covers, plus
        linked heads; sorted, always ending with the last token (its logits are sampled)."""
        computed = torch.ones(self.num_tokens, dtype=torch.bool)
        computed[: self.num_prefix_tokens] = False
        for p in self.placed:
            computed[p.segment.start + p.num_linked : p.segment.end] = False
        computed[-1] = True
        return computed.nonzero().flatten()  # (R,)

    def blend_positions(self) -> list[torch.Tensor]:
        """Per placed segment, the positions blend may recompute (empty for other methods)."""
        out = []
        for p in self.placed:
            start = p.segment.start + p.num_linked
            end = min(p.segment.end, self.num_tokens - 1)  # the last token is computed in full
            out.append(torch.arange(start, end) if p.method == "blend" else torch.empty(0, dtype=torch.long))
        return out

    def outcomes(self) -> list[SegmentOutcome]:
        placed = []
        for i, p in enumerate(self.placed):
            n = p.segment.num_tokens
            recomputed = p.num_linked + self.num_selected.get(i, 0)
            if p.segment.end == self.num_tokens and p.num_linked < n:
                recomputed += 1  # the last prompt token
            placed.append(SegmentOutcome(p.segment, p.method, n - recomputed, recomputed))
        return sorted(self.dense + placed, key=lambda o: o.segment.start)


class Assembler:
    def __init__(self, config: ReuseConfig, index: SegmentIndex | None, no_index_reason: str | None = None) -> None:
        self.config = config
        self.index = index
        self.no_index_reason = no_index_reason or "segment reuse is disabled"

    def assemble(self, segments: list[TokenSegment], token_ids: list[int], num_prefix_tokens: int) -> Assembly:
        """Decide every segment; placed entries are pinned until `release`."""
        num_tokens = len(token_ids)
        placed: list[PlacedSegment] = []
        dense: list[SegmentOutcome] = []
        for seg in segments:
            if seg.end <= num_prefix_tokens:
                dense.append(SegmentOutcome(seg, "prefix", seg.num_tokens, 0))
                continue
            num_hit = max(num_prefix_tokens - seg.start, 0)  # a segment the prefix hit covers in part
            method = seg.method or self.config.default_method
            reason = self._refusal(seg, method, num_hit) if seg.is_reusable else None
            entry = None
            if seg.is_reusable and reason is None:
                entry = self.index.lookup(token_ids[seg.start : seg.end]) if self.index else None
                reason = None if entry is not None else "not in the segment index (never cached or evicted)"
            if entry is None:
                dense.append(SegmentOutcome(seg, "prefix" if num_hit else "dense", num_hit,
                                            seg.num_tokens - num_hit, reason))
                continue
            self.index.acquire(entry)
            num_linked = min(self.config.link_tokens, seg.num_tokens) if method == "link" and seg.start > 0 else 0
            placed.append(PlacedSegment(seg, method, entry, num_linked))
        return Assembly(num_tokens, num_prefix_tokens, placed, dense)

    def _refusal(self, seg: TokenSegment, method: ReuseMethod, num_hit: int) -> str | None:
        """Why this segment must be computed densely, or None if it may be placed."""
        if method in ("dense", "prefix"):
            return f"method {method}"
        if num_hit:
            return "partly covered by the prefix cache"
        if seg.num_tokens < self.config.min_segment_tokens:
            return f"shorter than min_segment_tokens ({self.config.min_segment_tokens})"
        if self.index is None:
            return self.no_index_reason
        return None

    def release(self, assembly: Assembly) -> None:
        """Unpin the placed entries (once; later calls do nothing)."""
        if self.index is not None and assembly.pinned:
            for p in assembly.placed:
                self.index.release(p.entry)
        assembly.pinned = False
