"""CacheImage: one prompt's KV as the DiffStore is asked to keep it.

A prompt's KV is stored from `region_start` on: the tokens before it sit in exact,
published prefix-cache blocks already. Within the region, some tokens hold a cached
segment's KV moved there unchanged (keys = the segment's canonical keys shifted by the
segment's start): `CanonicalRun`s. The store keeps those tokens in the canonical frame,
as the segment's own values, so that every prompt holding the same segment at any
position is restored from the same stored values by the very rotation that placed
them: that is what makes a sibling's cache equal the master's, bit for bit, wherever
both reused a segment unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.kv.hashing import DEFAULT_TENANT


class CanonicalRun(NamedTuple):
    start: int  # prompt position of the segment's first token
    key: bytes  # the segment's identity: the same text has the same key in every prompt
    src_slots: torch.Tensor  # (n,) cache slots of the segment's KV in the canonical frame
    exact: torch.Tensor  # (n,) bool: tokens whose KV is the canonical KV shifted by `start`, untouched since

    @property
    def num_tokens(self) -> int:
        return int(self.src_slots.shape[0])


class CacheImage(NamedTuple):
    token_ids: tuple[int, ...]  # the whole prompt
    slots: torch.Tensor  # (T,) its cache slots, KV computed (or placed) for every token
    region_start: int  # stored from here on; [0, region_start) is in the prefix cache
    runs: list[CanonicalRun]  # in prompt order, inside the region
    spans: tuple[tuple[int, int], ...] = ()  # other segments' [start, end): where the prompt's structure cuts
    tenant: str = DEFAULT_TENANT  # whose cache it is: only that tenant's prompts restore it

    def cuts(self) -> list[int]:
        """Region rows where a segment starts or ends (runs and spans), sorted, with 0 and n."""
        n = self.num_region_tokens
        bounds = {0, n}
        for start, end in [(r.start, r.start + r.num_tokens) for r in self.runs] + list(self.spans):
            bounds.update(min(max(p - self.region_start, 0), n) for p in (start, end))
        return sorted(bounds)

    @property
    def num_region_tokens(self) -> int:
        return len(self.token_ids) - self.region_start

    def canonical_rows(self) -> list[tuple[int, bytes, int, int]]:
        """(region row, segment key, offset in the segment, canonical slot) of every exact token."""
        out = []
        for run in self.runs:
            for offset in run.exact.nonzero().flatten().tolist():
                row = run.start + offset - self.region_start
                if row >= 0:
                    out.append((row, run.key, offset, int(run.src_slots[offset])))
        return out
