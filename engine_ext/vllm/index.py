"""TierIndex: which of the connector's tiers holds each block, and what the files must do.

The scheduler process decides and the worker process copies (vLLM runs them apart), so
the index lives with the scheduler and every change it makes comes back as file
operations, in order, for the worker to carry out: `BlockSave` (vLLM block -> tier),
`BlockLoad` (tier -> vLLM block) and `BlockMove` (tier -> tier, or deleted). The worker
runs them in the order they were issued, so a block the index places somewhere is there
by the time a later step reads it.

The tiers are exclusive (a block lives in one) and each holds at most its budget of
blocks. A new block goes to host; a full host demotes its policy victim to disk; a full
disk deletes its victim. Candidates reach the policy least recently used first, so LRU
breaks ties, as in the embedded engine's tiers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal, NamedTuple

from engine_ext.kv.eviction import EvictionPolicy

TierName = Literal["host", "disk"]


class BlockSave(NamedTuple):
    block_hash: bytes
    tier: TierName
    block_id: int  # vLLM's block to copy from
    request_id: str  # whose computation it is: not saved once that request's load failed


class BlockLoad(NamedTuple):
    block_hash: bytes
    tier: TierName
    block_id: int  # vLLM's block to copy into
    request_id: str


class BlockMove(NamedTuple):
    block_hash: bytes
    source: TierName
    target: TierName | None  # None: delete


FileOp = BlockSave | BlockMove


class TierIndex:
    def __init__(self, num_host_blocks: int, num_disk_blocks: int, policy: EvictionPolicy) -> None:
        self.capacity: dict[TierName, int] = {"host": num_host_blocks, "disk": num_disk_blocks}
        self.policy = policy
        self._blocks: dict[TierName, OrderedDict[bytes, None]] = {"host": OrderedDict(), "disk": OrderedDict()}
        self.num_demotions = 0
        self.num_deletions = 0

    def where(self, block_hash: bytes) -> TierName | None:
        for tier, blocks in self._blocks.items():
            if block_hash in blocks:
                return tier
        return None

    def num_blocks(self, tier: TierName) -> int:
        return len(self._blocks[tier])

    def touch(self, block_hash: bytes) -> None:
        """The block was just read: most recently used in its tier."""
        tier = self.where(block_hash)
        if tier is not None:
            self._blocks[tier].move_to_end(block_hash)

    def touch_chain(self, chain: tuple[bytes, ...] | list[bytes]) -> None:
        """A prefix was just used: its blocks become the most recently used, the first
        block last. Among blocks of equal priority a prefix then loses its tail first,
        never its head, which would make the blocks after it unreachable (hits are
        counted from the start of the chain)."""
        for block_hash in reversed(chain):
            self.touch(block_hash)

    def adopt(self, block_hash: bytes, tier: TierName) -> bool:
        """A block already in the tier's files (found at start-up). False when another
        tier has it already (tiers are exclusive; that file is a duplicate)."""
        if self.where(block_hash) is not None:
            return False
        self._blocks[tier][block_hash] = None
        return True

    def add(self, block_hash: bytes, block_id: int, request_id: str) -> list[FileOp]:
        """Save a new block from vLLM's `block_id`, computed for `request_id`: the ops
        that make room, then the save. Nothing when the block is already kept."""
        if self.where(block_hash) is not None:
            return []
        tier: TierName = "host" if self.capacity["host"] else "disk"
        ops = self._make_room(tier, lambda h: True) or []
        self._blocks[tier][block_hash] = None
        return [*ops, BlockSave(block_hash, tier, block_id, request_id)]

    def promote(self, block_hash: bytes, spares: Callable[[bytes], bool]) -> list[FileOp]:
        """Move a disk block to host, demoting a host block only if `spares` allows;
        nothing when there is no such room."""
        if self.where(block_hash) != "disk" or not self.capacity["host"]:
            return []
        del self._blocks["disk"][block_hash]  # out first, so a demotion to disk cannot pick it
        room = self._make_room("host", spares)
        if room is None:
            self._blocks["disk"][block_hash] = None
            return []
        self._blocks["host"][block_hash] = None
        return [*room, BlockMove(block_hash, "disk", "host")]

    def drop(self, block_hash: bytes) -> list[FileOp]:
        """Forget a block that must not be loaded again: the op that deletes its file."""
        tier = self.where(block_hash)
        if tier is None:
            return []
        del self._blocks[tier][block_hash]
        return [BlockMove(block_hash, tier, None)]

    def _make_room(self, tier: TierName, spares: Callable[[bytes], bool]) -> list[FileOp] | None:
        """Ops that leave one free block in `tier` (cascading host -> disk -> deleted)."""
        blocks = self._blocks[tier]
        if len(blocks) < self.capacity[tier]:
            return []
        victims = self.policy.victims(((h, h) for h in blocks), 1)
        if not victims or not spares(victims[0]):
            return None
        victim = victims[0]
        del blocks[victim]
        if tier == "host" and self.capacity["disk"]:
            ops = self._make_room("disk", lambda h: True) or []
            self._blocks["disk"][victim] = None
            self.num_demotions += 1
            return [*ops, BlockMove(victim, "host", "disk")]
        self.num_deletions += 1
        return [BlockMove(victim, tier, None)]
