"""Fixed-size KV blocks: reference counts, content hashes and an LRU of reusable blocks.

A block whose reference count drops to zero keeps its contents and its hash so a later
request with the same prefix can take it back (automatic prefix caching). Such blocks
sit in `_free`, an OrderedDict kept in LRU order: a cache hit removes a block from the
middle in O(1), which a deque cannot do. Which free blocks an allocation takes is the
eviction policy's call (engine_ext/tiers): plain LRU takes the least recently freed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine_ext.kv.eviction import EvictionPolicy, LruPolicy


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.policy = policy or LruPolicy()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free ones and evictable cached ones)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[bytes]:
        """Hashes of every block that can serve a prefix hit now, in use or evictable.
        Safe from another thread: copying a dict of bytes keys runs under the GIL."""
        return list(self._cached)

    def lookup(self, block_hash: bytes) -> Block | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def touch(self, block: Block) -> None:
        """Take a reference on a cached block, pulling it out of the LRU if it was free."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def count_free(self, spares: Callable[[bytes | None], bool]) -> int:
        """Free blocks whose contents `spares` (given the block's hash) lets go."""
        return sum(1 for block_id in self._free if spares(self.blocks[block_id].block_hash))

    def allocate(self, num_blocks: int, spares: Callable[[bytes | None], bool] | None = None) -> list[Block]:
        """Hand out `num_blocks` fresh blocks, evicting the cached ones the policy picks
        (among those `spares` lets go, when given)."""
        candidates: Iterable[tuple[int, bytes | None]] = \
            ((block_id, self.blocks[block_id].block_hash) for block_id in self._free)
        num_candidates = len(self._free)
        if spares is not None:
            candidates = [(block_id, block_hash) for block_id, block_hash in candidates if spares(block_hash)]
            num_candidates = len(candidates)
        if num_blocks > num_candidates:
            raise MemoryError(f"need {num_blocks} KV blocks, {num_candidates} free")
        out = []
        for block_id in self.policy.victims(candidates, num_blocks):
            del self._free[block_id]
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference from each block. Callers pass blocks tail-first so a
        sequence's last blocks are evicted before its (more shareable) first ones."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def register(self, block: Block, block_hash: bytes) -> None:
        """Publish a full block's hash so later prompts can reuse it. If another block
        already holds the same content, the first one stays canonical."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block.block_id

    def forget(self, block: Block) -> None:
        """Drop a block's published hash (its contents are stale); it stays allocated or free."""
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None

    def reset_cache(self) -> None:
        """Forget every cached hash (after a model change or a failed step)."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
