"""Assembler: decides, segment by segment, where a prompt's KV comes from.

Given the tokens the prefix cache already covers, each remaining segment of the plan is
either placed (its cached KV copied in at its new position, by shift, blend, link or
kvcomm) or computed densely, with the reason. The guard lives here: a segment is placed
only when the segment index holds exactly its tokens; anything else is computed.

A `kvcomm` placeholder asks the AnchorBank (engine_ext/kvcomm): predicted, it is placed
with an offset correction, and so is the fixed segment right after it; not predicted,
both are computed densely and the placeholder is measured once the prompt is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from engine_ext.config import ReuseConfig
from engine_ext.kv.hashing import DEFAULT_TENANT
from engine_ext.kv.segment_index import SegmentEntry, SegmentIndex
from engine_ext.kvcomm import AnchorBank, ChunkedCorrection, Correction, Decision, Measurement
from engine_ext.reuse.locks import BlobLock, CacheLock, SegmentLock
from engine_ext.reuse.methods import METHODS
from engine_ext.reuse.segments import (
    OutcomeMethod,
    ReuseScope,
    SegmentOutcome,
    TokenSegment,
)
from kvrelay.wire.plan import ReuseMethod

# Segments KVCOMM corrects with prefix offsets when they follow a placeholder.
_FOLLOWER_KINDS = frozenset({"fixed_prefix", "shared_block"})


class PlacedSegment(NamedTuple):
    segment: TokenSegment
    method: ReuseMethod  # shift | blend | link | kvcomm
    entry: SegmentEntry
    num_linked: int  # tokens at its start recomputed in every layer (link; the last prompt token)
    correction: Correction | ChunkedCorrection | None = None  # kvcomm: offsets added after the shift
    kvcomm: dict[str, Any] | None = None  # kvcomm: what the anchor bank decided, reported
    repair_ratio: float = 0.0  # share of its tokens the deviation check may send on to be recomputed


@dataclass
class Assembly:
    """One prompt's reuse decisions, then (after the prefill) what blend selected."""

    num_tokens: int  # tokens of the sequence (prompt, plus output after a preemption)
    num_prefix_tokens: int  # served by the prefix cache
    placed: list[PlacedSegment]
    dense: list[SegmentOutcome]  # outcomes of segments not placed
    num_selected: dict[int, int] = field(default_factory=dict)  # placed index -> blend rows kept
    decisions: list[Decision] = field(default_factory=list)  # kvcomm predictions, committed after the prefill
    measurements: list[Measurement] = field(default_factory=list)  # kvcomm samples to record after it
    collective: dict[str, Any] | None = None  # reported on placed segments when the prefill ran with its round group

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
        """Per placed segment, the positions the deviation check may recompute: a blend
        segment's (computed up to the check layers even at ratio 0, as CacheBlend does),
        another's only where it has a `repair_ratio`."""
        out = []
        for p in self.placed:
            start = p.segment.start + p.num_linked
            end = min(p.segment.end, self.num_tokens - 1)  # the last token is computed in full
            checked = METHODS[p.method].blends or p.repair_ratio > 0
            out.append(torch.arange(start, end) if checked else torch.empty(0, dtype=torch.long))
        return out

    def outcomes(self) -> list[SegmentOutcome]:
        placed = []
        for i, p in enumerate(self.placed):
            n = p.segment.num_tokens
            recomputed = p.num_linked + self.num_selected.get(i, 0)
            if p.segment.end == self.num_tokens and p.num_linked < n:
                recomputed += 1  # the last prompt token
            placed.append(SegmentOutcome(p.segment, p.method, n - recomputed, recomputed, kvcomm=p.kvcomm,
                                         collective=self.collective))
        return sorted(self.dense + placed, key=lambda o: o.segment.start)


class Assembler:
    def __init__(self, config: ReuseConfig, index: SegmentIndex | None, no_index_reason: str | None = None,
                 bank: AnchorBank | None = None) -> None:
        self.config = config
        self.index = index
        self.bank = bank
        self.no_index_reason = no_index_reason or "segment reuse is disabled"

    def assemble(self, segments: list[TokenSegment], token_ids: list[int], num_prefix_tokens: int,
                 scope: ReuseScope | None = None, restored_from: int | None = None) -> Assembly:
        """Decide every segment; what it reads is pinned, a lock each in `locks(assembly)`. The first
        `num_prefix_tokens` are cached already: exactly (the prefix cache), or from
        `restored_from` on restored from a stored round cache."""
        assembly = Assembly(len(token_ids), num_prefix_tokens, [], [])
        tenant = scope.tenant if scope is not None else DEFAULT_TENANT
        index = self.index
        i = 0
        while i < len(segments):
            seg = segments[i]
            covered: OutcomeMethod = "restored" if restored_from is not None and seg.end > restored_from else "prefix"
            if seg.end <= num_prefix_tokens:
                assembly.dense.append(SegmentOutcome(seg, covered, seg.num_tokens, 0))
                i += 1
                continue
            num_hit = max(num_prefix_tokens - seg.start, 0)  # a segment the prefix hit covers in part
            method = seg.method or self.config.default_method
            reason = self._refusal(seg, method, num_hit) if seg.is_reusable else None
            entry = None
            if seg.is_reusable and reason is None:
                entry = index.lookup(token_ids[seg.start : seg.end], tenant) if index is not None else None
                reason = None if entry is not None else "not in the segment index (never cached or evicted)"
            if index is None or entry is None:  # without an index nothing was found
                assembly.dense.append(SegmentOutcome(seg, covered if num_hit else "dense", num_hit,
                                                     seg.num_tokens - num_hit, reason))
                i += 1
                continue
            if METHODS[method].uses_anchors:
                follower = segments[i + 1] if i + 1 < len(segments) else None
                i += self._kvcomm(index, assembly, seg, entry, follower, token_ids, scope)
                continue
            index.acquire(entry)
            spec = METHODS[method]
            assembly.placed.append(PlacedSegment(seg, method, entry, spec.num_linked(seg, self.config),
                                                 repair_ratio=spec.repair_ratio(self.config)))
            i += 1
        return assembly

    def locks(self, assembly: Assembly) -> list[CacheLock]:
        """A lock for every pin `assemble` took: placed entries, measured bases, then
        the blobs of kvcomm predictions (the order they are let go in). The caller
        holds them (engine_ext/reuse/lifecycle.py) until the prefill is done."""
        if self.index is None:
            return []
        locks: list[CacheLock] = [SegmentLock(self.index, p.entry) for p in assembly.placed]
        locks += [SegmentLock(self.index, m.base) for m in assembly.measurements]
        if self.bank is not None:  # kvcomm decisions come from the bank alone
            locks += [BlobLock(self.bank.blobs, blob) for d in assembly.decisions for blob in self.bank.blobs_of(d)]
        return locks

    def _kvcomm(self, index: SegmentIndex, assembly: Assembly, seg: TokenSegment, entry: SegmentEntry,
                follower: TokenSegment | None, token_ids: list[int], scope: ReuseScope | None) -> int:
        """Decide a kvcomm segment (and the fixed segment after a placeholder); returns
        how many segments it consumed. A shared block or fixed prefix on its own, with no
        placeholder before it, has no anchors: it is placed by the RoPE shift alone.

        A placeholder is decided chunk by chunk (engine_ext/kvcomm/bank.py). It is placed
        only when every chunk is predicted; else it is computed densely whole and every
        chunk is measured (a chunk computed behind predicted ones would be measured
        against approximate KV, and the dense computation is paid either way)."""
        bank = self.bank
        if seg.kind != "placeholder" or bank is None or scope is None or scope.agent_id is None:
            index.acquire(entry)
            assembly.placed.append(PlacedSegment(seg, "shift", entry, 0))
            return 1
        if follower is not None and (follower.kind not in _FOLLOWER_KINDS or follower.start > seg.end + 8
                                     or follower.method not in (None, "kvcomm")
                                     or follower.num_tokens < self.config.min_segment_tokens):
            follower = None  # only a fixed segment right after it (template tokens apart) is its prefix
        follower_ids = tuple(token_ids[follower.start : follower.end]) if follower else None
        chunks = _chunks(seg.num_tokens, self.config.anchors.chunk_tokens)
        decisions = []
        for j, (start, end) in enumerate(chunks):
            pool = (scope.tenant, scope.app_id, seg.name or "", j)  # anchors never cross tenants
            fallback = tuple(pool[:3] + (i,) for i in range(j - 1, -1, -1))
            last = j == len(chunks) - 1
            decisions.append(bank.decide(pool, scope.agent_id, tuple(token_ids[seg.start + start : seg.start + end]),
                                         entry, follower_ids if last else None, start, fallback))
        detail = _summary(decisions)
        if not all(d.predicted for d in decisions):
            for (start, end), decision in zip(chunks, decisions):
                last = end == seg.num_tokens
                index.acquire(entry)  # a pin per measurement: each lets go of its own (`locks`)
                assembly.measurements.append(Measurement(
                    bank.measuring(decision), tuple(token_ids[seg.start + start : seg.start + end]),
                    seg.start + start, entry, follower_ids if last else None,
                    follower.start if follower and last else 0, scope.tenant, start))
            assembly.dense.append(SegmentOutcome(seg, "dense", 0, seg.num_tokens, "kvcomm: measured as an anchor",
                                                 kvcomm=detail))
            if follower is not None:
                assembly.dense.append(SegmentOutcome(follower, "dense", 0, follower.num_tokens,
                                                     "kvcomm: measured after its placeholder"))
            return 2 if follower is not None else 1
        index.acquire(entry)
        for decision in decisions:
            for blob in bank.blobs_of(decision):
                bank.blobs.acquire(blob)
        assembly.decisions += decisions
        parts = [(start, d.placeholder) for (start, _), d in zip(chunks, decisions) if d.placeholder is not None]
        correction = None if not parts else parts[0][1] if len(parts) == 1 else ChunkedCorrection(parts)
        # Reproduced from its own exact anchors, its KV (and its follower's) is the real KV already.
        exact = all(d.detail["anchor"] == "exact" for d in decisions)
        repair = 0.0 if exact else METHODS["kvcomm"].repair_ratio(self.config)
        assembly.placed.append(PlacedSegment(seg, "kvcomm", entry, 0, correction, detail, repair))
        if follower is None:
            return 1
        self._follower(index, bank, assembly, follower, follower_ids, decisions[-1], scope.tenant, repair)
        return 2

    def _follower(self, index: SegmentIndex, bank: AnchorBank, assembly: Assembly, follower: TokenSegment,
                  follower_ids: tuple[int, ...] | None, decision: Decision, tenant: str, repair: float) -> None:
        """Place the fixed segment after a predicted placeholder with the prefix offsets
        of its last chunk's anchors (and the placeholder's `repair` ratio), or compute it."""
        # In full mode the follower needs its prefix offsets; the ablation modes place it shifted alone.
        corrected = decision.prefix is not None or bank.correction != "full"
        follower_entry = index.lookup(follower_ids, tenant) if corrected and follower_ids else None
        # Prefix offsets are added only to the version of its entry they were measured against.
        stale = decision.prefix is None and bool(decision.detail.get("stale_prefix_offsets"))
        if (follower_entry is not None and decision.prefix is not None
                and follower_entry.identity != decision.prefix_base):
            follower_entry, stale = None, True
        reason = ("kvcomm: its prefix offsets were measured against another version of it" if stale
                  else "kvcomm: no prefix offset measured for it")
        if follower_entry is None:
            assembly.dense.append(SegmentOutcome(follower, "dense", 0, follower.num_tokens, reason))
        else:
            index.acquire(follower_entry)
            assembly.placed.append(PlacedSegment(follower, "kvcomm", follower_entry, 0, decision.prefix,
                                                 repair_ratio=repair))

    def _refusal(self, seg: TokenSegment, method: ReuseMethod, num_hit: int) -> str | None:
        """Why this segment must be computed densely, or None if it may be placed."""
        spec = METHODS[method]
        if not spec.places:
            return f"method {method}"
        if num_hit:
            return "partly covered by the prefix cache"
        if seg.num_tokens < self.config.min_segment_tokens:
            return f"shorter than min_segment_tokens ({self.config.min_segment_tokens})"
        if spec.num_recomputed(seg, self.config) >= seg.num_tokens:
            return f"{method} would compute as many tokens as computing it"
        if self.index is None:
            return self.no_index_reason
        return None

    def commit(self, assembly: Assembly, prompt_slots: torch.Tensor) -> None:
        """After the prefill: activate the anchors predictions used, record measurements."""
        if self.bank is None:
            return
        for decision in assembly.decisions:
            self.bank.commit(decision)
        if assembly.measurements:
            self.bank.record_all(assembly.measurements, prompt_slots)


def _chunks(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """A placeholder's chunks as (start, end) within it: `chunk_tokens` each, the last shorter."""
    return [(start, min(start + chunk_tokens, num_tokens)) for start in range(0, num_tokens, chunk_tokens)]


def _summary(decisions: list[Decision]) -> dict[str, Any]:
    """What the anchor bank decided for a placeholder, reported on its outcome: a single
    chunk's detail as it is; for several, the first unpredicted chunk's verdict (or
    when all were predicted, their common verdict, `hit` for a mix) and counts over the chunks."""
    if len(decisions) == 1:
        return decisions[0].detail
    missed = next((d for d in decisions if not d.predicted), None)
    if missed is not None:
        anchor = missed.detail["anchor"]
    else:
        verdicts = {d.detail["anchor"] for d in decisions}
        anchor = verdicts.pop() if len(verdicts) == 1 else "hit"
    detail: dict[str, Any] = {"anchor": anchor, "anchors_used": sum(d.detail["anchors_used"] for d in decisions),
                              "chunks": len(decisions), "chunks_predicted": sum(d.predicted for d in decisions)}
    fallbacks = sum("from_chunk" in d.detail for d in decisions)
    if fallbacks:
        detail["chunks_from_earlier_positions"] = fallbacks
    stale = sum(d.detail.get("stale_anchors", 0) for d in decisions)
    if stale:
        detail["stale_anchors"] = stale
    return detail
