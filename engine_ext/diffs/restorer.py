"""Restorer: serves the start of a new prompt from a stored round cache.

In a round-based app an agent's next prompt usually extends its previous one (its
history, the round it read, its answer, then the new round). The previous prompt's
KV beyond the prefix cache was approximate (placed and partly recomputed) and is never
published to the prefix cache, so without the DiffStore it would be reused again, or
computed again, segment by segment. With it, the stored cache (a master, or a mirror
applied while copying) is restored into the new sequence's blocks, exactly the KV the
agent's previous request ran on, and counts as cached.

Only requests that carry a plan are served (a plan is the client's consent to reuse),
none that asks for exact prefix or dense computation of a reusable segment in the
restored region (by its own method or the engine's default), and no lossy mirror (a
DiffStore with a tolerance keeps them for accounting only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.diffs.store import DiffStore
from engine_ext.diffs.stored import CacheView, StoredCache, StoredMirror
from engine_ext.kv.cache import KVCache
from engine_ext.reuse.locks import CacheLock, StoredCacheLock
from engine_ext.reuse.methods import METHODS
from engine_ext.sequence import Sequence
from kvrelay.wire.plan import ReuseMethod


class Restore(NamedTuple):
    stored: StoredCache
    view: CacheView
    region_start: int  # restored tokens are [region_start, num_tokens)
    num_tokens: int
    lock: CacheLock  # the pin on `stored`, let go once it is applied or the admission is undone


class Restorer:
    def __init__(self, store: DiffStore, kv_cache: KVCache, default_method: ReuseMethod = "prefix") -> None:
        self.store = store
        self.kv_cache = kv_cache
        self.default_method = default_method  # what a segment naming no method asks for
        self.num_restores = 0
        self.num_restored_tokens = 0

    def find(self, seq: Sequence, num_prefix_tokens: int) -> Restore | None:
        """A stored prompt this one extends, pinned (its `lock`) until `apply` or the lock's release; or None."""
        if not seq.segments:
            return None
        found = self.store.match(seq.token_ids, num_prefix_tokens, seq.tenant)
        if found is None:
            return None
        stored, view = found
        if isinstance(stored, StoredMirror) and self.store.tolerance > 0:
            return None  # a lossy mirror is not the KV the agent ran on
        if any(s.is_reusable and not METHODS[s.method or self.default_method].places and s.start < view.num_tokens
               and s.end > view.region_start for s in seq.segments):
            return None
        self.store.acquire(stored)
        return Restore(stored, view, view.region_start, view.num_tokens, StoredCacheLock(self.store, stored))

    def apply(self, restore: Restore, slots: torch.Tensor) -> None:
        """Write the stored region into the sequence's slots (T,) and unpin it."""
        try:
            restore.view.restore(self.kv_cache.layers, slots[restore.region_start : restore.num_tokens])
        finally:
            restore.lock.release()
        self.num_restores += 1
        self.num_restored_tokens += restore.num_tokens - restore.region_start
