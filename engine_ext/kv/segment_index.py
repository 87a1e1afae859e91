"""SegmentIndex: the KV of token segments, reusable at any position of any prompt.

The prefix cache can only serve a prompt's first tokens. A segment (a document, another
agent's answer) recurs at different positions behind different prefixes, so its KV is
kept apart, keyed by the segment's tokens alone, in one canonical frame: keys rotated
as if the segment started at position 0. Using it elsewhere is one RoPE shift away.

Segment KV lives in blocks of the same pool as the prefix cache, so it shares the one
memory budget and the one LRU eviction: an entry's blocks are published under hashes
derived from the segment's content under a segment root (never equal to a prefix hash) and released at once, so
they sit in the LRU like any cached prefix block. An entry is valid while every block
still carries its hash; one evicted block invalidates the entry and later lookups miss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.kv.block_pool import Block, BlockPool
from engine_ext.kv.cache import KVCache
from engine_ext.kv.hashing import chain_hash, namespace_root
from engine_ext.rope import RopeShifter


class SegmentEntry(NamedTuple):
    token_ids: tuple[int, ...]
    blocks: list[Block]
    block_hashes: list[bytes]


class SegmentIndex:
    def __init__(self, pool: BlockPool, kv_cache: KVCache, shifter: RopeShifter, namespace: str) -> None:
        self.pool = pool
        self.kv_cache = kv_cache
        self.shifter = shifter
        self.block_size = kv_cache.block_size
        self.root = namespace_root(f"{namespace}\x00segment")
        self._entries: dict[bytes, SegmentEntry] = {}
        self.num_hits = 0
        self.num_misses = 0
        self.num_registered = 0
        self.num_skipped = 0  # registrations refused for lack of free blocks

    # -- lookup ------------------------------------------------------------------------
    def _hashes(self, token_ids: tuple[int, ...]) -> list[bytes]:
        """One hash per block of the segment, all derived from the hash of the whole
        segment: two segments sharing their first tokens must not share block hashes."""
        whole = chain_hash(self.root, token_ids)
        num_blocks = -(-len(token_ids) // self.block_size)
        return [chain_hash(whole, (i,)) for i in range(num_blocks)]

    def _valid(self, entry: SegmentEntry) -> bool:
        return all(b.block_hash == h for b, h in zip(entry.blocks, entry.block_hashes))

    def lookup(self, token_ids: list[int] | tuple[int, ...]) -> SegmentEntry | None:
        """The entry holding exactly these tokens, or None (never cached, or evicted)."""
        entry = self._find(tuple(token_ids))
        if entry is None:
            self.num_misses += 1
        else:
            self.num_hits += 1
        return entry

    def _find(self, tokens: tuple[int, ...]) -> SegmentEntry | None:
        if not tokens:
            return None
        key = self._hashes(tokens)[-1]
        entry = self._entries.get(key)
        if entry is not None and not self._valid(entry):
            self._drop(key, entry)
            return None
        return entry if entry is not None and entry.token_ids == tokens else None  # tokens guard collisions

    def acquire(self, entry: SegmentEntry) -> None:
        """Pin an entry's blocks (they leave the LRU) until `release`."""
        for block in entry.blocks:
            self.pool.touch(block)

    def release(self, entry: SegmentEntry) -> None:
        self.pool.release(list(reversed(entry.blocks)))

    def slots(self, entry: SegmentEntry) -> torch.Tensor:
        """Cache slots of the entry's tokens in order, (n,)."""
        bs = self.block_size
        ids = torch.tensor([b.block_id for b in entry.blocks], dtype=torch.long)
        return (ids[:, None] * bs + torch.arange(bs)[None, :]).flatten()[: len(entry.token_ids)]

    # -- registration ------------------------------------------------------------------
    def register(self, token_ids: list[int], src_slots: torch.Tensor, src_position: int) -> bool:
        """Copy the KV at `src_slots` (tokens computed from position `src_position` on)
        into new blocks, keys shifted back to position 0. The first registration of a
        token sequence wins; False when it is already held or no block is free."""
        tokens = tuple(token_ids)
        if not tokens or self._find(tokens) is not None:
            return False
        num_blocks = -(-len(tokens) // self.block_size)
        if num_blocks > self.pool.num_free:
            self.num_skipped += 1
            return False
        blocks = self.pool.allocate(num_blocks)
        hashes = self._hashes(tokens)
        entry = SegmentEntry(tokens, blocks, hashes)
        self.copy_shifted(src_slots, self.slots(entry), -src_position)
        for block, block_hash in zip(blocks, hashes):
            self.pool.register(block, block_hash)
        self.pool.release(list(reversed(blocks)))
        self._entries[hashes[-1]] = entry
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
        for block, block_hash in zip(entry.blocks, entry.block_hashes):
            if block.block_hash == block_hash:
                self.pool.forget(block)

    def _prune(self) -> None:
        """Drop dead entries once they could outnumber the blocks (each live one holds one)."""
        if len(self._entries) <= self.pool.num_blocks:
            return
        for key, entry in list(self._entries.items()):
            if not self._valid(entry):
                self._drop(key, entry)

    # -- accounting --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(len(e.blocks) for e in self._entries.values() if self._valid(e))

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.kv_cache.bytes_per_block
