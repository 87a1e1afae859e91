"""Maps sequences to KV blocks: prefix-cache lookup, slot allocation, publication, release.

The manager is the one writer of `Sequence.num_computed_tokens`: how many of a
sequence's tokens have their K/V in its blocks is a fact about those blocks, so it
changes only here (a prefix hit, `computed`, `reset`), whoever computed, fetched or
restored the KV.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.kv.block_pool import Block, BlockPool
from engine_ext.kv.eviction import EvictionPolicy
from engine_ext.kv.hashing import block_hashes, chain_hash, namespace_root, tenant_root
from engine_ext.sequence import Sequence


class PrefixMatch(NamedTuple):
    blocks: list[Block]
    num_cached_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, namespace: str, policy: EvictionPolicy | None = None) -> None:
        self.pool = BlockPool(num_blocks, policy)
        self.block_size = block_size
        self.root = namespace_root(namespace)
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def root_of(self, seq: Sequence) -> bytes:
        """The hash chain's start: the model's, or a multi-LoRA adapter's own (its K/V
        differ), then the request's tenant's own under it."""
        base = seq.adapter.hash_root if seq.adapter is not None and seq.adapter.hash_root is not None else self.root
        return tenant_root(base, seq.tenant)

    def prefix_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Chained hashes of the full blocks among the sequence's first `num_tokens` tokens."""
        bs = self.block_size
        num_full = min(num_tokens, len(seq.token_ids)) // bs
        if len(seq.block_hashes) < num_full:
            root = self.root_of(seq)
            parent = seq.block_hashes[-1] if seq.block_hashes else root
            seq.block_hashes += block_hashes(
                root, seq.token_ids[: num_full * bs], bs, start=len(seq.block_hashes), parent=parent
            )
        return seq.block_hashes[:num_full]

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Longest run of cached full blocks at the start of the sequence's tokens,
        leaving at least one token to compute (its logits are needed), and every token
        whose logits the sequence keeps (`Sequence.max_prefix_tokens`)."""
        bs = self.block_size
        self.prefix_hashes(seq, len(seq.token_ids))
        max_blocks = seq.max_prefix_tokens // bs
        hits: list[Block] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.num_lookup_tokens += len(seq.token_ids)
        return PrefixMatch(hits, len(hits) * bs)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Reserve slots for `num_new_tokens` more tokens (after any prefix hit).
        Returns False, changing nothing, when the pool cannot supply them now."""
        hits = prefix.blocks if prefix else []
        num_cached = prefix.num_cached_tokens if prefix else 0
        num_needed = self.num_new_blocks(seq, num_new_tokens, prefix)
        # Taking a hit that sits unreferenced in the LRU also consumes a free block.
        num_revived = sum(1 for b in hits if b.ref_count == 0)
        if num_needed + num_revived > self.pool.num_free:
            return False
        for block in hits:
            self.pool.touch(block)
        seq.blocks += hits + self.pool.allocate(num_needed)
        if prefix:
            seq.num_computed_tokens += num_cached
            self.num_hit_tokens += num_cached
        return True

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> int:
        """Fresh blocks `allocate` would take from the pool for these tokens (prefix hits
        are not fresh): the ones that evict cached KV when the pool has no empty block."""
        num_cached = prefix.num_cached_tokens if prefix else 0
        num_hits = len(prefix.blocks) if prefix else 0
        total = seq.num_computed_tokens + num_cached + num_new_tokens
        return max(self.num_blocks_for(total) - len(seq.blocks) - num_hits, 0)

    def slots(self, seq: Sequence, end: int) -> torch.Tensor:
        """Cache slots of the sequence's tokens [0, end), shape (end,)."""
        bs = self.block_size
        num_blocks = self.num_blocks_for(end)
        block_ids = torch.tensor([b.block_id for b in seq.blocks[:num_blocks]], dtype=torch.long)
        return (block_ids[:, None] * bs + torch.arange(bs)[None, :]).flatten()[:end]

    def publish(self, seq: Sequence) -> list[Block]:
        """Register hashes of blocks that became full and computed, so others can reuse
        them; blocks holding approximate KV (from num_exact_tokens on) never are.
        Returns the blocks this call published."""
        bs = self.block_size
        num_exact = seq.num_computed_tokens if seq.num_exact_tokens is None else \
            min(seq.num_computed_tokens, seq.num_exact_tokens)
        num_full = num_exact // bs
        published = []
        for idx in range(seq.num_published_blocks, num_full):
            if idx == len(seq.block_hashes):
                parent = seq.block_hashes[-1] if seq.block_hashes else self.root_of(seq)
                seq.block_hashes.append(chain_hash(parent, seq.token_ids[idx * bs : (idx + 1) * bs]))
            block = seq.blocks[idx]
            self.pool.register(block, seq.block_hashes[idx])
            if block.block_hash == seq.block_hashes[idx]:
                published.append(block)
        seq.num_published_blocks = max(seq.num_published_blocks, num_full)
        return published

    def computed(self, seq: Sequence, end: int) -> None:
        """The sequence's tokens [0, end) now have their K/V in its blocks (computed by a
        step, fetched from a lower tier, or restored from a round cache)."""
        if not seq.num_computed_tokens <= end <= len(seq.blocks) * self.block_size:
            raise ValueError(f"{seq.request_id}: {end} computed tokens, from {seq.num_computed_tokens}, "
                             f"do not fit its {len(seq.blocks)} blocks")
        seq.num_computed_tokens = end

    def free(self, seq: Sequence) -> None:
        """Let go of a finished sequence's blocks (they stay cached for reuse); its count
        of computed tokens stays, as a record of what it ran."""
        self.pool.release(list(reversed(seq.blocks)))
        seq.blocks = []
        seq.num_published_blocks = 0

    def reset(self, seq: Sequence) -> None:
        """Let go of the blocks of a sequence that will be computed again (preempted, or
        its admission undone): none of its tokens is computed any more."""
        self.free(seq)
        seq.num_computed_tokens = 0
