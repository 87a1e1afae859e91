"""SegmentIndex: the KV of token segments, reusable at any position of any prompt.

The prefix cache can only serve a prompt's first tokens. A segment (a document, another
agent's answer) recurs at different positions behind different prefixes, so its KV is
kept apart, keyed by the segment's tokens alone, in one canonical frame: keys rotated
as if the segment started at position 0. Using it elsewhere is one RoPE shift away.

Segment KV lives in blobs (kv/blobs.py): blocks of the prefix cache's pool, so it shares
the one memory budget and the one LRU eviction. A blob's key is the hash of the
segment's tokens under a segment root (never equal to a prefix hash); one evicted block
invalidates the entry and later lookups miss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.kv.blobs import Blob, BlobStore
from engine_ext.kv.block_pool import BlockPool
from engine_ext.kv.cache import KVCache
from engine_ext.kv.hashing import DEFAULT_TENANT, chain_hash, namespace_root, tenant_root
from engine_ext.rope import RopeShifter


class SegmentEntry(NamedTuple):
    token_ids: tuple[int, ...]
    blob: Blob  # the segment's KV, keys in the canonical frame

    @property
    def key(self) -> bytes:
        """The segment's identity across prompts (the same tokens give the same key)."""
        return self.blob.block_hashes[0]


class SegmentIndex:
    def __init__(self, pool: BlockPool, kv_cache: KVCache, shifter: RopeShifter, namespace: str) -> None:
        self.pool = pool
        self.kv_cache = kv_cache
        self.shifter = shifter
        self.blobs = BlobStore(pool, kv_cache)
        self.root = namespace_root(f"{namespace}\x00segment")
        self._entries: dict[bytes, SegmentEntry] = {}
        self.num_hits = 0
        self.num_misses = 0
        self.num_registered = 0
        self.num_skipped = 0  # registrations refused for lack of free blocks

    # -- lookup ------------------------------------------------------------------------
    def _key(self, token_ids: tuple[int, ...], tenant: str) -> bytes:
        return chain_hash(tenant_root(self.root, tenant), token_ids)

    def lookup(self, token_ids: list[int] | tuple[int, ...], tenant: str = DEFAULT_TENANT) -> SegmentEntry | None:
        """The entry holding exactly these tokens for `tenant`, or None (never cached by
        that tenant, or evicted)."""
        entry = self._find(tuple(token_ids), tenant)
        if entry is None:
            self.num_misses += 1
        else:
            self.num_hits += 1
        return entry

    def _find(self, tokens: tuple[int, ...], tenant: str) -> SegmentEntry | None:
        if not tokens:
            return None
        key = self._key(tokens, tenant)
        entry = self._entries.get(key)
        if entry is not None and not self.blobs.valid(entry.blob):
            self._drop(key, entry)
            return None
        return entry if entry is not None and entry.token_ids == tokens else None  # tokens guard collisions

    def acquire(self, entry: SegmentEntry) -> None:
        """Pin an entry's blocks (they leave the LRU) until `release`."""
        self.blobs.acquire(entry.blob)

    def release(self, entry: SegmentEntry) -> None:
        self.blobs.release(entry.blob)

    def slots(self, entry: SegmentEntry) -> torch.Tensor:
        """Cache slots of the entry's tokens in order, (n,)."""
        return self.blobs.slots(entry.blob)

    # -- registration ------------------------------------------------------------------
    def register(self, token_ids: list[int], src_slots: torch.Tensor, src_position: int,
                 tenant: str = DEFAULT_TENANT) -> bool:
        """Copy the KV at `src_slots` (tokens computed from position `src_position` on)
        into new blocks, keys shifted back to position 0, for `tenant` alone. The first
        registration of a token sequence wins; False when it is already held or no block
        is free."""
        tokens = tuple(token_ids)
        if not tokens or self._find(tokens, tenant) is not None:
            return False
        key = self._key(tokens, tenant)
        blob = self.blobs.allocate(key, len(tokens))
        if blob is None:
            self.num_skipped += 1
            return False
        self.copy_shifted(src_slots, self.blobs.slots(blob), -src_position)
        self.blobs.seal(blob)
        self._entries[key] = SegmentEntry(tokens, blob)
        self.num_registered += 1
        self._prune()
        return True

    def copy_shifted(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        """Copy K and V of every layer from slots `src` to slots `dst` (both (n,)), keys
        moved `delta` positions: into the canonical frame at registration, out of it at use."""
        for k_cache, v_cache in self.kv_cache.layers:
            keys = self.shifter.shift(k_cache.index_select(0, src), delta)  # (n, kv_heads, D)
            k_cache.index_copy_(0, dst, keys)
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    def _drop(self, key: bytes, entry: SegmentEntry) -> None:
        """Forget an entry whose blocks were (partly) evicted; its survivors are stale."""
        del self._entries[key]
        self.blobs.discard(entry.blob)

    def _prune(self) -> None:
        """Drop dead entries once they could outnumber the blocks (each live one holds one)."""
        if len(self._entries) <= self.pool.num_blocks:
            return
        for key, entry in list(self._entries.items()):
            if not self.blobs.valid(entry.blob):
                self._drop(key, entry)

    # -- accounting --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(len(e.blob.blocks) for e in self._entries.values() if self.blobs.valid(e.blob))

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.kv_cache.bytes_per_block
