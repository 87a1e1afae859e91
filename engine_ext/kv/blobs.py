"""BlobStore: KV-shaped tensors kept in the prefix cache's own blocks.

A blob is `num_tokens` slots of every layer's K and V cache: a segment's KV in the
canonical frame (SegmentIndex), or a KVCOMM anchor's base KV and offsets. Keeping them
in pool blocks, published under hashes no prompt can produce and released into the
pool's LRU, gives every cache in the engine one memory budget and one eviction order:
a blob is valid while each of its blocks still carries its hash, and one evicted block
invalidates it (its holder then recomputes or forgets it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.kv.block_pool import Block, BlockPool
from engine_ext.kv.cache import KVCache
from engine_ext.kv.hashing import chain_hash


class Blob(NamedTuple):
    num_tokens: int
    blocks: list[Block]
    block_hashes: list[bytes]


class BlobStore:
    def __init__(self, pool: BlockPool, kv_cache: KVCache) -> None:
        self.pool = pool
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size

    def hashes(self, key: bytes, num_tokens: int) -> list[bytes]:
        """One hash per block, all derived from `key`: two blobs whose keys differ never
        share a block hash, even when their first tokens agree."""
        num_blocks = -(-num_tokens // self.block_size)
        return [chain_hash(key, (i,)) for i in range(num_blocks)]

    def allocate(self, key: bytes, num_tokens: int) -> Blob | None:
        """Fresh blocks for a blob, held (ref 1) until `seal`; None when too few are free."""
        hashes = self.hashes(key, num_tokens)
        if num_tokens <= 0 or len(hashes) > self.pool.num_free:
            return None
        return Blob(num_tokens, self.pool.allocate(len(hashes)), hashes)

    def seal(self, blob: Blob) -> None:
        """Publish a written blob's hashes and hand its blocks to the LRU."""
        for block, block_hash in zip(blob.blocks, blob.block_hashes):
            self.pool.register(block, block_hash)
        self.pool.release(list(reversed(blob.blocks)))

    def abandon(self, blob: Blob) -> None:
        """Give back a blob that was allocated but never sealed (writing it failed)."""
        self.pool.release(list(reversed(blob.blocks)))

    def valid(self, blob: Blob) -> bool:
        return all(b.block_hash == h for b, h in zip(blob.blocks, blob.block_hashes))

    def acquire(self, blob: Blob) -> None:
        """Pin a valid blob's blocks (they leave the LRU) until `release`."""
        for block in blob.blocks:
            self.pool.touch(block)

    def release(self, blob: Blob) -> None:
        self.pool.release(list(reversed(blob.blocks)))

    def discard(self, blob: Blob) -> None:
        """Forget a blob: its surviving blocks lose their hashes and become plain free blocks."""
        for block, block_hash in zip(blob.blocks, blob.block_hashes):
            if block.block_hash == block_hash:
                self.pool.forget(block)

    def slots(self, blob: Blob) -> torch.Tensor:
        """Cache slots of the blob's tokens in order, (n,)."""
        bs = self.block_size
        ids = torch.tensor([b.block_id for b in blob.blocks], dtype=torch.long)
        return (ids[:, None] * bs + torch.arange(bs)[None, :]).flatten()[: blob.num_tokens]

    def num_bytes(self, blob: Blob) -> int:
        return len(blob.blocks) * self.kv_cache.bytes_per_block
