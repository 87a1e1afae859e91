"""BlockTier: one lower tier's slots, which block hash sits where, and what may leave.

A slot is free, pending (a copy into it is in flight), ready (holds a block, readable)
or busy (ready, and a copy out of it is in flight). Only ready slots that are not busy
can be evicted, so no copy ever reads or writes a slot that changed hands. Every
method runs on the engine thread; the transfer worker only touches slots it was given.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Literal, NamedTuple

from engine_ext.kv.eviction import EvictionPolicy
from engine_ext.tiers.storage import DiskStorage, HostStorage

TierName = Literal["host", "disk"]


class Reservation(NamedTuple):
    slot: int
    evicted: bytes | None  # the hash that held the slot before, if one was evicted for it


class BlockTier:
    def __init__(self, name: TierName, storage: HostStorage | DiskStorage, policy: EvictionPolicy) -> None:
        self.name = name
        self.storage = storage
        self.policy = policy
        self.num_blocks = storage.blocks.shape[0]
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: pop() hands out slot 0 first
        self._ready: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._pending: dict[bytes, int] = {}
        self._busy: Counter[int] = Counter()
        self.num_evictions = 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._ready or block_hash in self._pending

    def ready_hashes(self) -> list[bytes]:
        """Hashes of the blocks ready to be read back (safe from another thread, as
        BlockPool.cached_hashes)."""
        return list(self._ready)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot of a ready block, or None."""
        return self._ready.get(block_hash)

    def reserve(self, block_hash: bytes) -> Reservation | None:
        """A slot to write `block_hash` into (pending until `commit`), evicting the
        policy's victim when the tier is full; None when every slot is in use by a copy."""
        evicted = None
        if not self._free:
            candidates = ((h, h) for h, slot in self._ready.items() if not self._busy[slot])
            victims = self.policy.victims(candidates, 1)
            if not victims:
                return None
            evicted = victims[0]
            self._free.append(self._ready.pop(evicted))
            self.num_evictions += 1
        slot = self._free.pop()
        self._pending[block_hash] = slot
        return Reservation(slot, evicted)

    def commit(self, block_hash: bytes) -> None:
        """The copy into the block's slot finished: it is ready (most recently used)."""
        self._ready[block_hash] = self._pending.pop(block_hash)

    def cancel(self, block_hash: bytes) -> None:
        """The copy into the block's slot failed: the slot is free again."""
        self._free.append(self._pending.pop(block_hash))

    def drop(self, block_hash: bytes) -> None:
        """Forget a ready block that could not be read back (its slot is free again)."""
        slot = self._ready.get(block_hash)
        if slot is not None and not self._busy[slot]:
            del self._ready[block_hash]
            self._free.append(slot)

    def pin(self, slot: int) -> None:
        self._busy[slot] += 1

    def unpin(self, slot: int) -> None:
        self._busy[slot] -= 1
        if self._busy[slot] <= 0:
            del self._busy[slot]

    def touch(self, block_hash: bytes) -> None:
        """Mark a ready block as just used (it was read back)."""
        if block_hash in self._ready:
            self._ready.move_to_end(block_hash)
