"""DeviceOrder: KVFlow's eviction order inside vLLM's own device cache.

vLLM keeps freed blocks that hold a prefix-cache entry in a free queue and evicts from
its front: least recently used first. The connector API hands the scheduler-side
connector vLLM's BlockPool (`bind_gpu_block_pool`), and through it this class reorders
that queue once per scheduler step, the way the embedded engine's WorkflowPolicy orders
its own cache:

    blocks in no agent's fixed prefix (varying suffixes)   <- evicted first, LRU as vLLM keeps them
    prefix blocks of the agent furthest from running
    ...
    prefix blocks of the agent due next                     <- evicted last

Only free blocks move (a block some request holds is not in the queue), so this only
decides which cached block vLLM gives up when it needs room; what any block holds is
never touched, and answers stay exactly vLLM's. The prefix's vLLM block hashes come
from the planned request (vLLM's own hashes, so lookups are vLLM's); steps-to-execution
come from the planner's WorkflowTable, which also forgets idle apps.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from engine_ext.tiers.workflow import AgentKey, WorkflowTable

FULL_ATTENTION_GROUP = [0]  # the connector refuses models with more than one KV cache group


class PoolBlock(Protocol):
    block_id: int
    ref_cnt: int


class FreeQueue(Protocol):
    def remove(self, block: PoolBlock) -> None: ...

    def append(self, block: PoolBlock) -> None: ...


class DevicePool(Protocol):
    """The parts of vLLM's BlockPool this class uses."""

    free_block_queue: FreeQueue

    def get_cached_block(self, block_hash: Hashable, kv_cache_group_ids: list[int]) -> Sequence[PoolBlock] | None: ...

    def evict_blocks(self, block_ids: set[int]) -> None: ...


class DeviceOrder:
    def __init__(self, table: WorkflowTable) -> None:
        self.table = table
        self.pool: DevicePool | None = None  # None until vLLM binds it (or for a pool-less test)
        self._prefixes: dict[AgentKey, tuple[Hashable, ...]] = {}  # vLLM's hashes of each agent's prefix blocks
        self.num_moves = 0

    def bind(self, pool: DevicePool) -> None:
        self.pool = pool

    def observe(self, agent: AgentKey, block_hashes: Sequence[Hashable]) -> None:
        """`agent`'s fixed prefix spans these vLLM blocks (vLLM's own block hashes). The
        agent seen last moves to the end: among agents equally far from running, the one
        seen longest ago gives up its blocks first (LRU among equals)."""
        if block_hashes:
            self._prefixes.pop(agent, None)
            self._prefixes[agent] = tuple(block_hashes)

    def unpublish(self, block_ids: Sequence[int]) -> None:
        """Take these blocks out of vLLM's prefix cache (they stay with their request):
        blocks holding approximate KV must never be another request's exact hit."""
        if self.pool is not None and block_ids:
            self.pool.evict_blocks(set(block_ids))

    def reorder(self) -> int:
        """Move the free blocks of known prefixes to the back of vLLM's free queue, the
        agent furthest from running first and the one due next last; the number moved."""
        if self.pool is None or not self._prefixes:
            return 0
        self.table.expire()
        known = self.table.agents()  # agents of live apps; the rest are forgotten here too
        self._prefixes = {agent: hashes for agent, hashes in self._prefixes.items() if agent in known}
        # Eviction order, first out first: (-steps, how recently the agent was seen, -chain position).
        ranked: dict[int, tuple[tuple[float, int, int], PoolBlock]] = {}
        for rank, (agent, hashes) in enumerate(self._prefixes.items()):
            steps = known[agent][0]
            for position, block_hash in enumerate(hashes):
                blocks = self.pool.get_cached_block(block_hash, FULL_ATTENTION_GROUP)
                if not blocks:
                    break  # vLLM matches prefixes from the start: blocks after a gap are never hit
                key, block = (-steps, rank, -position), blocks[0]
                earlier = ranked.get(block.block_id)
                if earlier is None or key > earlier[0]:  # a shared block stays as long as its keenest agent needs
                    ranked[block.block_id] = (key, block)
        free = sorted((entry for entry in ranked.values() if entry[1].ref_cnt == 0), key=lambda entry: entry[0])
        queue = self.pool.free_block_queue
        for _, block in free:
            queue.remove(block)
            queue.append(block)
        self.num_moves += len(free)
        return len(free)
