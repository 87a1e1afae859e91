"""TieredStore: the device tier (the KV pool) backed by host memory and/or disk (KVFlow, HiCache).

Write-through: every block the prefix cache publishes is copied down to the first
lower tier in the background, and the device block stays pinned (offloading) until the
copy lands, so evicting it later costs nothing and loses nothing. A lower tier that is
full evicts by the policy; the host tier hands its victims down to disk when there is
one. Reading back is either synchronous, into a request's own fresh blocks at
admission (reactive loading), or asynchronous, into free blocks that are published
once the copy lands (prefetch; the blocks are pinned and loading until then).

Node states (per block hash): loading, offloading, on device, on host, on disk.
Everything here runs on the engine thread; only the copies run on the worker.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from engine_ext.config import TierConfig
from engine_ext.kv.block_pool import Block, BlockPool
from engine_ext.kv.cache import KVCache
from engine_ext.kv.eviction import EvictionPolicy
from engine_ext.tiers.copies import device_to_tier, tier_to_device, tier_to_tier
from engine_ext.tiers.storage import DiskStorage, HostStorage
from engine_ext.tiers.tier import BlockTier
from engine_ext.tiers.worker import Transfer, TransferWorker

logger = logging.getLogger(__name__)


class NodeState(enum.Enum):
    ON_DEVICE = "on_device"
    ON_HOST = "on_host"
    ON_DISK = "on_disk"
    LOADING = "loading"
    OFFLOADING = "offloading"


class TierEntry(NamedTuple):
    block_hash: bytes
    tier: BlockTier
    slot: int


class LowerMatch(NamedTuple):
    entries: list[TierEntry]  # ready lower-tier blocks that continue a prompt's device prefix
    loading: bool  # the run stopped at a block that is still loading into the device tier


@dataclass
class TierStats:
    num_backed_up: int = 0  # blocks copied down from the device tier
    num_demoted: int = 0  # blocks moved from host to disk
    num_prefetched: int = 0  # blocks loaded back ahead of their request
    num_fetched: int = 0  # blocks loaded back at admission (reactive)
    fetch_seconds: float = 0.0  # time admissions spent loading
    num_failed: int = 0  # transfers that raised (their blocks are dropped, never half-used)


class TieredStore:
    def __init__(self, config: TierConfig, pool: BlockPool, kv_cache: KVCache, policy: EvictionPolicy) -> None:
        self.pool = pool
        self.kv_cache = kv_cache
        k = kv_cache.layers[0][0]
        block_shape = (len(kv_cache.layers), 2, kv_cache.block_size, *k.shape[1:])  # (L, 2, bs, H, D)
        dtype = k.dtype
        sizes = {"host": config.host_bytes, "disk": config.disk_bytes if config.disk_path is not None else 0}
        for name, num_bytes in sizes.items():
            if num_bytes and num_bytes < kv_cache.bytes_per_block:
                raise ValueError(f"the {name} tier's budget holds no block of {kv_cache.bytes_per_block} bytes")
        self.tiers: list[BlockTier] = []
        if sizes["host"]:
            num = sizes["host"] // kv_cache.bytes_per_block
            self.tiers.append(BlockTier("host", HostStorage((num, *block_shape), dtype), policy))
        if sizes["disk"] and config.disk_path is not None:  # no disk path: sizes["disk"] is 0
            num = sizes["disk"] // kv_cache.bytes_per_block
            self.tiers.append(BlockTier("disk", DiskStorage(config.disk_path, (num, *block_shape), dtype), policy))
        self.worker = TransferWorker()
        self._loading: dict[bytes, Block] = {}
        self._offloading: set[bytes] = set()
        self._backlog: deque[tuple[Block, bytes]] = deque()  # published blocks waiting for a lower-tier slot
        self.num_loads_in_flight = 0  # prefetch loads (one per agent prefix) not yet landed
        self.stats = TierStats()

    def state(self, block_hash: bytes) -> NodeState | None:
        if block_hash in self._loading:
            return NodeState.LOADING
        if block_hash in self._offloading or any(block_hash in t and t.lookup(block_hash) is None for t in self.tiers):
            return NodeState.OFFLOADING
        if self.pool.lookup(block_hash) is not None:
            return NodeState.ON_DEVICE
        for tier in self.tiers:
            if tier.lookup(block_hash) is not None:
                return NodeState.ON_HOST if tier.name == "host" else NodeState.ON_DISK
        return None

    # -- down: backups and demotions -------------------------------------------------
    def backup(self, blocks: list[Block]) -> None:
        """Copy newly published blocks to the first lower tier (each pinned until it lands).
        Blocks the tier has no slot for yet (every slot is being written) wait in a
        backlog, retried as copies land, for as long as the device still holds them."""
        if not self.tiers:
            return
        self._backlog.extend((block, block.block_hash) for block in blocks if block.block_hash is not None)
        top = self.tiers[0]
        todo: list[tuple[Block, bytes, int]] = []
        demotions: list[tuple[bytes, int]] = []
        while self._backlog:
            block, block_hash = self._backlog[0]
            if block.block_hash != block_hash or block_hash in self._offloading or \
                    any(block_hash in t for t in self.tiers):
                self._backlog.popleft()  # evicted meanwhile, or already kept
                continue
            reservation = top.reserve(block_hash)
            if reservation is None:
                break
            self._backlog.popleft()
            if reservation.evicted is not None:
                demotions.append((reservation.evicted, reservation.slot))
            todo.append((block, block_hash, reservation.slot))
        self._demote(demotions)  # submitted first: it reads the slots the backup then overwrites
        if not todo:
            return
        for block, block_hash, _ in todo:
            self.pool.touch(block)
            self._offloading.add(block_hash)
        ids, slots = [b.block_id for b, _, _ in todo], [s for _, _, s in todo]

        def copy() -> None:
            device_to_tier(self.kv_cache, ids, top.storage.blocks, slots)
            top.storage.settle(slots)

        def done(transfer: Transfer) -> None:
            for block, block_hash, _ in todo:
                self._offloading.discard(block_hash)
                (top.cancel if transfer.error else top.commit)(block_hash)
            self.pool.release([b for b, _, _ in reversed(todo)])
            self.stats.num_backed_up += 0 if transfer.error else len(todo)
            self.stats.num_failed += 1 if transfer.error else 0

        self.worker.submit(Transfer("backup", copy, done, len(todo)))

    def _demote(self, evicted: list[tuple[bytes, int]]) -> None:
        """Move blocks the host tier evicted down to disk; without a disk tier they are dropped."""
        if not evicted or len(self.tiers) < 2:
            return
        src, dst = self.tiers[0], self.tiers[1]
        moves = [(h, slot, r.slot) for h, slot in evicted if (r := dst.reserve(h)) is not None]
        if not moves:
            return
        src_slots, dst_slots = [m[1] for m in moves], [m[2] for m in moves]

        def copy() -> None:
            tier_to_tier(src.storage.blocks, src_slots, dst.storage.blocks, dst_slots)
            dst.storage.settle(dst_slots)

        def done(transfer: Transfer) -> None:
            for block_hash, _, _ in moves:
                (dst.cancel if transfer.error else dst.commit)(block_hash)
            self.stats.num_demoted += 0 if transfer.error else len(moves)
            self.stats.num_failed += 1 if transfer.error else 0

        self.worker.submit(Transfer("demote", copy, done, len(moves)))

    # -- up: matching, reactive fetches, prefetch loads --------------------------------
    def match(self, hashes: list[bytes]) -> LowerMatch:
        """The ready lower-tier blocks at the start of `hashes` (the part of a prompt's
        chain past its device prefix), stopping at the first block found nowhere."""
        entries: list[TierEntry] = []
        for block_hash in hashes:
            if block_hash in self._loading:
                return LowerMatch(entries, loading=True)
            entry = self._find(block_hash)
            if entry is None:
                break
            entries.append(entry)
        return LowerMatch(entries, loading=False)

    def fetch(self, entries: list[TierEntry], blocks: list[Block]) -> bool:
        """Copy matched blocks into a request's own blocks now, on the engine thread.
        False when reading failed: the entries are dropped, the request must recompute."""
        started = time.perf_counter()
        try:
            self._read_back(entries, blocks)
        except Exception:
            logger.exception("loading %d KV blocks back failed; they will be recomputed", len(entries))
            for entry in entries:
                entry.tier.drop(entry.block_hash)
            self.stats.num_failed += 1
            return False
        for entry in entries:
            entry.tier.touch(entry.block_hash)
        self.stats.num_fetched += len(entries)
        self.stats.fetch_seconds += time.perf_counter() - started
        return True

    def load(self, hashes: tuple[bytes, ...], spares: Callable[[bytes | None], bool], num_reserved: int) -> int:
        """Start loading the blocks of `hashes` that are off the device back into it, in
        the background; takes only free blocks `spares` allows and leaves `num_reserved`
        free blocks for running requests. Returns the number of blocks it started."""
        run: list[TierEntry] = []
        for block_hash in hashes:
            if block_hash in self._loading:
                return 0  # this prefix is already on its way
            if self.pool.lookup(block_hash) is not None:
                continue
            entry = self._find(block_hash)
            if entry is None:
                break  # blocks past a lost one are useless: the chain is broken there
            run.append(entry)
        if not run:  # checked first: counting what `spares` lets go walks every free block
            return 0
        room = min(self.pool.count_free(spares), self.pool.num_free - num_reserved)
        run = run[: max(room, 0)]
        if not run:
            return 0
        blocks = self.pool.allocate(len(run), spares)
        for entry, block in zip(run, blocks):
            self._loading[entry.block_hash] = block
            entry.tier.pin(entry.slot)

        def copy() -> None:
            self._read_back(run, blocks)

        def done(transfer: Transfer) -> None:
            self.num_loads_in_flight -= 1
            for entry, block in zip(run, blocks):
                del self._loading[entry.block_hash]
                entry.tier.unpin(entry.slot)
                if transfer.error is None:
                    self.pool.register(block, entry.block_hash)
                    entry.tier.touch(entry.block_hash)
                else:  # unreadable: recomputed when next needed, not retried forever
                    entry.tier.drop(entry.block_hash)
            self.pool.release(list(reversed(blocks)))
            self.stats.num_prefetched += 0 if transfer.error else len(run)
            self.stats.num_failed += 1 if transfer.error else 0

        self.num_loads_in_flight += 1
        self.worker.submit(Transfer("load", copy, done, len(run)))
        return len(run)

    def poll(self, timeout: float = 0.0) -> None:
        """Apply finished transfers; wait up to `timeout` s for one when some are in flight."""
        completed = self.worker.completed(timeout)
        for transfer in completed:
            self._finish(transfer)
        if completed and self._backlog:
            self.backup([])

    def close(self) -> None:
        """Stop the worker once the transfers in flight have landed; nothing new starts."""
        self._backlog.clear()
        self.worker.close()
        for transfer in self.worker.completed():
            self._finish(transfer)
        for tier in self.tiers:
            tier.storage.close()

    def _finish(self, transfer: Transfer) -> None:
        """Apply one landed transfer; a bookkeeping error is logged so it cannot strand
        the transfers that landed with it (their pins and states are undone by theirs)."""
        try:
            transfer.on_done(transfer)
        except Exception:
            logger.exception("finishing a KV %s of %d blocks failed", transfer.kind, transfer.num_blocks)

    def _read_back(self, entries: list[TierEntry], blocks: list[Block]) -> None:
        """Copy each entry's tier slot into its device block, one batch per tier (runs on
        whichever thread calls it: the engine's for fetches, the worker's for loads)."""
        for tier in self.tiers:
            pairs = [(e.slot, b.block_id) for e, b in zip(entries, blocks) if e.tier is tier]
            if pairs:
                slots = [slot for slot, _ in pairs]
                tier_to_device(tier.storage.blocks, slots, self.kv_cache, [block_id for _, block_id in pairs])
                tier.storage.forget(slots)

    def _find(self, block_hash: bytes) -> TierEntry | None:
        for tier in self.tiers:
            slot = tier.lookup(block_hash)
            if slot is not None:
                return TierEntry(block_hash, tier, slot)
        return None
