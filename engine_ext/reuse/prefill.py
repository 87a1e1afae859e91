"""ReusePrefill: computes a prompt around cached segments placed at new positions.

1. Copy each placed segment's KV into the sequence's slots, keys shifted from the
   canonical frame (position 0) to where the segment now starts; a kvcomm segment
   then gets its predicted offset added.
2. Run the model over the positions that must be computed, and only those: queries
   at non-contiguous positions, each attending to every key at or before it (cached
   or fresh), through an explicit mask.
3. Blend (CacheBlend): blend segments' tokens are also computed in the layers up to
   the last check layer; their fresh keys are compared with the placed ones there, and
   only the `blend_ratio` that deviate most stay in the computation for the deeper
   layers. The others keep the placed KV from there on. A kvcomm placeholder predicted
   from other samples' anchors goes through the same check with its own
   `anchors.recompute_ratio` (PlacedSegment.repair_ratio), when that is set.

The placed KV is approximate (it was computed behind another prefix), so none of this
sequence's blocks from the first placed token on are published to the prefix cache.
"""

from __future__ import annotations

import math
import time

import torch

from engine_ext.config import ReuseConfig
from engine_ext.kv.cache import KVCache
from engine_ext.kv.segment_index import SegmentIndex
from engine_ext.model import AttentionMetadata, CausalLM
from engine_ext.model.attention import PrefillSpan
from engine_ext.kvcomm.offsets import Piece, apply_corrections
from engine_ext.reuse.assembler import Assembly, PlacedSegment
from engine_ext.timeline import Placement, Timeline
from engine_ext.kernels.rope import rope_cos_sin


class ReusePrefill:
    def __init__(self, model: CausalLM, kv_cache: KVCache, index: SegmentIndex, config: ReuseConfig) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.index = index
        self.config = config
        self.last_check = max(config.check_layers)

    @torch.inference_mode()
    def run(self, assembly: Assembly, token_ids: list[int], slots: torch.Tensor,
            timeline: Timeline | None = None) -> torch.Tensor:
        """Fill and compute the sequence's KV for positions [num_prefix, len(token_ids));
        slots (T,) are its cache slots; `timeline` gets when each method placed its KV.
        Returns the final hidden state of the last token (1, hidden)."""
        self._place(assembly, slots, timeline)
        full = assembly.full_positions()  # (R,)
        blend = assembly.blend_positions()  # per placed segment, (n_i,)
        candidates = torch.cat(blend) if blend else torch.empty(0, dtype=torch.long)  # (C,)
        rows, _ = torch.sort(torch.cat((full, candidates)))  # (R + C,)
        is_candidate = torch.isin(rows, candidates)  # (R + C,)
        deviation = torch.zeros(int(is_candidate.sum()))  # (C,) summed over check layers
        context = slots[: len(token_ids)]  # (T,)
        tokens = torch.tensor(token_ids, dtype=torch.long)
        x: torch.Tensor = self.model.embed_tokens(tokens[rows])  # (R + C, hidden); nn.Module calls are typed Any
        inputs = self._inputs(rows, slots, context)
        for layer_idx, (layer, cache) in enumerate(zip(self.model.layers, self.kv_cache.layers)):
            # A check layer: the candidates' slots and their placed keys, read before the layer overwrites them.
            placed: tuple[torch.Tensor, torch.Tensor] | None = None
            if candidates.numel() > 0 and layer_idx in self.config.check_layers:
                cand_slots = slots[rows[is_candidate]]
                placed = cand_slots, cache[0].index_select(0, cand_slots)  # (C, kv_heads, D)
            cos, sin, meta = inputs
            x = layer(x, cos, sin, cache, meta)
            if placed is not None:
                cand_slots, placed_keys = placed
                fresh = cache[0].index_select(0, cand_slots)
                deviation += (fresh.float() - placed_keys.float()).pow(2).sum(dim=(-2, -1)).sqrt()
            if layer_idx == self.last_check and candidates.numel() > 0:
                keep = self._select(assembly, blend, deviation)  # (C,) bool
                kept = ~is_candidate
                kept[is_candidate] = keep
                rows, x, is_candidate = rows[kept], x[kept], is_candidate[kept]
                candidates = torch.empty(0, dtype=torch.long)
                inputs = self._inputs(rows, slots, context)
        hidden: torch.Tensor = self.model.norm(x[-1:])  # rows are sorted: the last one is the last token
        return hidden

    def _inputs(self, rows: torch.Tensor, slots: torch.Tensor,
                context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """cos, sin and attention metadata for queries at positions `rows`; rebuilt only
        when the rows change (the mask alone is rows x context)."""
        cos, sin = rope_cos_sin(self.model.inv_freq, rows)  # each (Q, rotary_dim)
        return cos, sin, _metadata(rows, slots, context)

    def _place(self, assembly: Assembly, slots: torch.Tensor, timeline: Timeline | None) -> None:
        """Copy every placed segment's KV to its slots, shifted to its position, then add
        all KVCOMM corrections in one batched pass (offsets.apply_corrections); each
        segment's placement time is its copy plus its token share of that pass."""
        copies: list[tuple[PlacedSegment, float]] = []
        pieces: list[Piece] = []
        for placed in assembly.placed:
            started = time.monotonic()
            seg = placed.segment
            dst = slots[seg.start : seg.end]
            self.index.copy_shifted(self.index.slots(placed.entry), dst, seg.start)
            copies.append((placed, time.monotonic() - started))
            if placed.correction is not None:
                pieces += placed.correction.pieces(dst, seg.start)
        started = time.monotonic()
        apply_corrections(self.kv_cache, self.index.shifter, pieces)
        corrected_s = time.monotonic() - started
        corrected_tokens = sum(p.dst.numel() for p in pieces)
        if timeline is None:
            return
        at = started - sum(copy_s for _, copy_s in copies)  # the spans are laid end to end
        for placed, copy_s in copies:
            seg = placed.segment
            share = corrected_s * seg.num_tokens / corrected_tokens if placed.correction is not None and corrected_tokens else 0.0
            timeline.placed(placed.method, Placement(at, at + copy_s + share, seg.num_tokens))
            at += copy_s + share

    def _select(self, assembly: Assembly, blend: list[torch.Tensor], deviation: torch.Tensor) -> torch.Tensor:
        """Keep the top `repair_ratio` of each placed segment's candidates by key
        deviation. Per segment, not globally, so a segment that happens to deviate less
        than its neighbours still gets its most affected tokens repaired."""
        keep = torch.zeros_like(deviation, dtype=torch.bool)
        offset = 0
        for i, positions in enumerate(blend):
            n = positions.numel()
            if n == 0:
                continue
            num_keep = min(n, math.ceil(assembly.placed[i].repair_ratio * n))
            if num_keep:
                top = deviation[offset : offset + n].topk(num_keep).indices
                keep[offset + top] = True
            assembly.num_selected[i] = num_keep
            offset += n
        return keep


def _metadata(rows: torch.Tensor, slots: torch.Tensor, context: torch.Tensor) -> AttentionMetadata:
    """One prefill span of queries at positions `rows` over the whole context: query i
    sees every key at a position <= rows[i] (placed, cached or written this layer)."""
    span = PrefillSpan(start=0, num_tokens=rows.shape[0], context_slots=context, positions=rows)
    return AttentionMetadata(slots[rows], [span], rows.shape[0], None, None)
