"""WorkflowPolicy: KVFlow's eviction order, from the steps-to-execution of the agents
whose fixed prefixes hold each block (WorkflowTable)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from engine_ext.kv.eviction import EvictionPolicy, Item
from engine_ext.tiers.workflow import WorkflowTable


class WorkflowPolicy(EvictionPolicy):
    """KVFlow: empty blocks, then blocks in no agent's fixed prefix (varying suffixes,
    blobs), then prefix blocks from the most steps-to-execution down; LRU among equals.
    A block shared by several agents (or workflows) takes the smallest of their steps."""

    def __init__(self, table: WorkflowTable) -> None:
        self.table = table

    def victims(self, candidates: Iterable[tuple[Item, bytes | None]], num: int) -> list[Item]:
        ranked = heapq.nsmallest(
            num,
            ((self._key(block_hash, position), item) for position, (item, block_hash) in enumerate(candidates)),
            key=lambda pair: pair[0],
        )
        return [item for _, item in ranked]

    def spares(self, block_hash: bytes | None, steps: float) -> bool:
        if block_hash is None:
            return True
        priority = self.table.priority(block_hash)
        return priority is None or priority > steps

    def _key(self, block_hash: bytes | None, position: int) -> tuple[int, float, int]:
        if block_hash is None:
            return (0, 0.0, position)
        priority = self.table.priority(block_hash)
        if priority is None:
            return (1, 0.0, position)
        return (2, -priority, position)  # the most steps away goes first
