"""BlockTier slot bookkeeping over HostStorage, and DiskStorage's file-backed blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine_ext.errors import ModelLoadError
from engine_ext.kv.eviction import EvictionPolicy, LruPolicy
from engine_ext.tiers.policy import WorkflowPolicy
from engine_ext.tiers.storage import DiskStorage, HostStorage
from engine_ext.tiers.tier import BlockTier, Reservation
from engine_ext.tiers.workflow import AgentKey, WorkflowTable

BLOCK_SHAPE = (2, 2, 4, 1, 8)  # (L, 2, bs, H, D): 512 bytes of float32


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def host_tier(num_blocks: int, policy: EvictionPolicy | None = None) -> BlockTier:
    return BlockTier("host", HostStorage((num_blocks, *BLOCK_SHAPE), torch.float32), policy or LruPolicy())


def fill(tier: BlockTier, *hashes: bytes) -> dict[bytes, int]:
    """Reserve and commit each hash; its slot."""
    slots = {}
    for block_hash in hashes:
        reservation = tier.reserve(block_hash)
        assert reservation is not None and reservation.evicted is None
        tier.commit(block_hash)
        slots[block_hash] = reservation.slot
    return slots


# -- BlockTier ---------------------------------------------------------------------------

def test_reserve_fills_free_slots_first() -> None:
    tier = host_tier(3)
    assert tier.num_blocks == 3 and tier.num_used == 0
    got = [tier.reserve(h(i)) for i in range(3)]
    assert got == [Reservation(0, None), Reservation(1, None), Reservation(2, None)]
    assert tier.num_used == 3 and tier.num_evictions == 0


def test_pending_is_in_the_tier_but_not_readable_until_committed() -> None:
    tier = host_tier(2)
    reservation = tier.reserve(h(0))
    assert h(0) in tier
    assert tier.lookup(h(0)) is None
    tier.commit(h(0))
    assert tier.lookup(h(0)) == reservation.slot
    assert h(1) not in tier and tier.lookup(h(1)) is None


def test_cancel_frees_the_slot() -> None:
    tier = host_tier(1)
    reservation = tier.reserve(h(0))
    assert tier.reserve(h(1)) is None  # the only slot is being written
    tier.cancel(h(0))
    assert h(0) not in tier and tier.num_used == 0
    assert tier.reserve(h(1)) == Reservation(reservation.slot, None)


def test_a_full_tier_evicts_the_least_recently_used() -> None:
    tier = host_tier(3)
    slots = fill(tier, h(0), h(1), h(2))
    tier.touch(h(0))  # read back: now the most recently used
    assert tier.reserve(h(3)) == Reservation(slots[h(1)], h(1))
    assert h(1) not in tier and tier.lookup(h(1)) is None
    assert tier.num_used == 3 and tier.num_evictions == 1
    assert tier.reserve(h(4)) == Reservation(slots[h(2)], h(2))
    assert tier.reserve(h(5)) == Reservation(slots[h(0)], h(0))
    assert tier.reserve(h(6)) is None  # h3, h4, h5 all pending: nothing may leave
    assert tier.num_used == 3 and tier.num_evictions == 3
    tier.commit(h(4))
    assert tier.reserve(h(6)) == Reservation(slots[h(2)], h(4))


def test_touch_ignores_unknown_and_pending_hashes() -> None:
    tier = host_tier(2)
    fill(tier, h(0))
    tier.reserve(h(1))
    tier.touch(h(1))
    tier.touch(h(9))
    tier.commit(h(1))
    assert tier.reserve(h(2)).evicted == h(0)


def test_a_full_tier_evicts_by_the_workflow_policy() -> None:
    table = WorkflowTable()
    table.observe(AgentKey("app", "near"), (h(0),), {"near": 1, "far": 4})
    table.observe(AgentKey("app", "far"), (h(1),), None)
    tier = host_tier(3, WorkflowPolicy(table))
    slots = fill(tier, h(0), h(1), h(2))  # LRU would take h(0) first
    assert tier.reserve(h(10)) == Reservation(slots[h(2)], h(2))  # in no prefix
    tier.commit(h(10))  # in no prefix either, but the most recently used of none now
    assert tier.reserve(h(11)) == Reservation(slots[h(2)], h(10))
    assert tier.reserve(h(12)) == Reservation(slots[h(1)], h(1))  # 4 steps away
    assert tier.reserve(h(13)) == Reservation(slots[h(0)], h(0))  # 1 step away, last
    assert tier.reserve(h(14)) is None


def test_pinned_slots_are_never_evicted() -> None:
    tier = host_tier(2)
    slots = fill(tier, h(0), h(1))
    tier.pin(slots[h(0)])
    tier.pin(slots[h(0)])  # two readers
    assert tier.reserve(h(2)) == Reservation(slots[h(1)], h(1))  # h0 is older, but busy
    assert tier.reserve(h(3)) is None  # h0 busy, h2 pending
    tier.unpin(slots[h(0)])
    assert tier.reserve(h(3)) is None  # one reader left
    assert tier.lookup(h(0)) == slots[h(0)]
    tier.unpin(slots[h(0)])
    assert tier.reserve(h(3)) == Reservation(slots[h(0)], h(0))


def test_drop_forgets_a_ready_block_unless_busy() -> None:
    tier = host_tier(2)
    slots = fill(tier, h(0), h(1))
    tier.pin(slots[h(1)])
    tier.drop(h(1))  # a copy is reading it: stays
    tier.drop(h(0))
    tier.drop(h(9))  # unknown: nothing
    assert h(0) not in tier and tier.lookup(h(1)) == slots[h(1)]
    assert tier.num_used == 1
    assert tier.reserve(h(2)) == Reservation(slots[h(0)], None)


def test_random_operations_keep_the_slot_books_consistent() -> None:
    rng = random.Random(0)
    tier = host_tier(4)
    live: dict[bytes, int] = {}  # hash -> slot, pending or ready
    pending: set[bytes] = set()
    pins: dict[int, int] = {}
    for i in range(400):
        op = rng.random()
        if op < 0.4:
            reservation = tier.reserve(h(i))
            if reservation is not None:
                if reservation.evicted is not None:
                    evicted_slot = live.pop(reservation.evicted)
                    assert reservation.evicted not in pending and not pins.get(evicted_slot)
                live[h(i)] = reservation.slot
                pending.add(h(i))
        elif op < 0.65 and pending:
            block_hash = rng.choice(sorted(pending))
            pending.discard(block_hash)
            if rng.random() < 0.8:
                tier.commit(block_hash)
            else:
                tier.cancel(block_hash)
                del live[block_hash]
        elif op < 0.85:
            ready = sorted(set(live) - pending)
            if ready:
                slot = live[rng.choice(ready)]
                tier.pin(slot)
                pins[slot] = pins.get(slot, 0) + 1
        else:
            busy = sorted(s for s, n in pins.items() if n)
            if busy:
                slot = rng.choice(busy)
                tier.unpin(slot)
                pins[slot] -= 1
        assert tier.num_used == len(live) <= tier.num_blocks
        assert len(set(live.values())) == len(live)  # no slot holds two hashes
        for block_hash, slot in live.items():
            assert block_hash in tier
            assert tier.lookup(block_hash) == (None if block_hash in pending else slot)


# -- DiskStorage ----------------------------------------------------------------------------

def test_disk_blocks_read_back_bit_exactly_from_an_unlinked_file(tmp_path: Path) -> None:
    shape = (4, 2, 2, 16, 2, 16)  # 8 KiB blocks: page-aligned
    storage = DiskStorage(str(tmp_path), shape, torch.float32)
    assert list(tmp_path.glob("kvrelay-kv-*.bin")) == []  # unlinked as soon as mapped
    assert storage.blocks.shape == shape
    gen = torch.Generator().manual_seed(0)
    data = {slot: torch.randn(shape[1:], generator=gen) for slot in (1, 3)}
    for slot, block in data.items():
        storage.blocks[slot] = block
    storage.settle([1, 3])
    for slot, block in data.items():
        assert torch.equal(storage.blocks[slot], block)
    assert not storage.blocks[0].any() and not storage.blocks[2].any()  # untouched: zeros
    assert list(tmp_path.iterdir()) == []


def test_disk_blocks_that_share_pages_survive_each_others_settle(tmp_path: Path) -> None:
    shape = (40, 1, 2, 3, 1, 7)  # 168-byte blocks: many per page, some straddle two
    storage = DiskStorage(str(tmp_path / "a" / "b"), shape, torch.float32)  # directories created
    gen = torch.Generator().manual_seed(1)
    data = torch.randn(shape, generator=gen)
    for slot in reversed(range(shape[0])):
        storage.blocks[slot] = data[slot]
        storage.settle([slot])
    assert torch.equal(storage.blocks, data)
    storage.settle(list(range(shape[0])))
    assert torch.equal(storage.blocks, data)
    assert list((tmp_path / "a" / "b").iterdir()) == []


def test_a_disk_tier_round_trips_through_its_slots(tmp_path: Path) -> None:
    tier = BlockTier("disk", DiskStorage(str(tmp_path), (2, *BLOCK_SHAPE), torch.float32), LruPolicy())
    block = torch.randn(BLOCK_SHAPE, generator=torch.Generator().manual_seed(2))
    reservation = tier.reserve(h(0))
    tier.storage.blocks[reservation.slot] = block
    tier.storage.settle([reservation.slot])
    tier.commit(h(0))
    assert torch.equal(tier.storage.blocks[tier.lookup(h(0))], block)


def test_a_disk_directory_that_cannot_be_created_raises_model_load_error(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_text("not a directory")
    with pytest.raises(ModelLoadError, match="disk KV tier"):
        DiskStorage(str(regular / "kv"), (2, *BLOCK_SHAPE), torch.float32)
    with pytest.raises(ModelLoadError):
        DiskStorage(str(regular), (2, *BLOCK_SHAPE), torch.float32)
