"""TieredStore over a real KVCache and BlockPool: backups, demotions, matches, fetches, loads, failures, budgets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import engine_ext.tiers.store as store_module
from engine_ext.config import EngineConfig, ModelConfig, TierConfig
from engine_ext.kv.block_pool import Block, BlockPool
from engine_ext.kv.cache import KVCache
from engine_ext.kv.eviction import EvictionPolicy, LruPolicy
from engine_ext.tiers.policy import WorkflowPolicy
from engine_ext.tiers.store import LowerMatch, NodeState, TieredStore
from engine_ext.tiers.workflow import AgentKey, WorkflowTable

BS = 16
MODEL = ModelConfig(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
    qkv_bias=False, qk_norm=False,
)
BLOCK_BYTES = 2 * MODEL.num_layers * BS * MODEL.num_kv_heads * MODEL.head_dim * 4  # float32: 8 KiB


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Rig(NamedTuple):
    store: TieredStore
    pool: BlockPool
    kv: KVCache


MakeRig = Callable[..., Rig]


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[MakeRig]:
    stores: list[TieredStore] = []

    def make(*, device_blocks: int = 8, host_blocks: int = 4, disk_blocks: int = 0,
             policy: EvictionPolicy | None = None) -> Rig:
        kv = KVCache(MODEL, EngineConfig(kv_cache_bytes=device_blocks * BLOCK_BYTES, block_size=BS))
        assert kv.bytes_per_block == BLOCK_BYTES and kv.num_blocks == device_blocks
        policy = policy or LruPolicy()
        pool = BlockPool(kv.num_blocks, policy)
        config = TierConfig(host_bytes=host_blocks * BLOCK_BYTES,
                            disk_path=str(tmp_path / "disk") if disk_blocks else None,
                            disk_bytes=disk_blocks * BLOCK_BYTES)
        store = TieredStore(config, pool, kv, policy)
        stores.append(store)
        gen = torch.Generator().manual_seed(len(stores))
        for k, v in kv.layers:
            k.copy_(torch.randn(k.shape, generator=gen))
            v.copy_(torch.randn(v.shape, generator=gen))
        return Rig(store, pool, kv)

    yield make
    for store in stores:
        store.close()


def device_block(kv: KVCache, block_id: int) -> torch.Tensor:
    """A device block as a tier stores it: (L, 2, bs, H, D), copied."""
    rows = slice(block_id * BS, (block_id + 1) * BS)
    return torch.stack([torch.stack((k[rows], v[rows])) for k, v in kv.layers]).clone()


def tier_block(store: TieredStore, block_hash: bytes) -> torch.Tensor:
    (entry,) = store.match([block_hash]).entries
    return entry.tier.storage.blocks[entry.slot].clone()


def randomize(kv: KVCache, block_id: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = slice(block_id * BS, (block_id + 1) * BS)
    for k, v in kv.layers:
        k[rows] = torch.randn(k[rows].shape, generator=gen)
        v[rows] = torch.randn(v[rows].shape, generator=gen)


def publish(pool: BlockPool, hashes: list[bytes]) -> list[Block]:
    """Fresh blocks holding `hashes` (one reference each, as a running request holds them)."""
    blocks = pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes):
        pool.register(block, block_hash)
    return blocks


def evict_device(pool: BlockPool) -> None:
    """Evict every cached free block (as a burst of new requests would), then free them again."""
    pool.release(pool.allocate(pool.num_free))


def zero_device(kv: KVCache) -> None:
    for k, v in kv.layers:
        k.zero_()
        v.zero_()


def drain(store: TieredStore) -> None:
    """Apply every transfer in flight (and whatever they let start)."""
    for _ in range(200):
        store.poll(timeout=0.05)
        if store.worker.num_in_flight == 0:
            return
    raise AssertionError("transfers did not land")


def back_up(rig: Rig, hashes: list[bytes]) -> dict[bytes, torch.Tensor]:
    """Publish `hashes` on the device, back them up, wait, free them; their device contents."""
    blocks = publish(rig.pool, hashes)
    expected = {b.block_hash: device_block(rig.kv, b.block_id) for b in blocks}
    rig.store.backup(blocks)
    drain(rig.store)
    rig.pool.release(blocks[::-1])
    return expected


# -- down: backups and demotions ------------------------------------------------------------

def test_backup_pins_blocks_until_the_copy_lands(make_rig: MakeRig) -> None:
    store, pool, kv = rig = make_rig(host_blocks=4)
    hashes = [h(0), h(1), h(2)]
    blocks = publish(pool, hashes)
    pool.release(blocks)  # cached and free: evictable, were it not for the backup
    expected = {x: device_block(kv, b.block_id) for x, b in zip(hashes, blocks)}
    store.backup(blocks)
    host = store.tiers[0]
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert [store.state(x) for x in hashes] == [NodeState.OFFLOADING] * 3
    assert all(x in host and host.lookup(x) is None for x in hashes)
    assert store.match(hashes) == LowerMatch([], loading=False)  # pending: not readable yet
    others = pool.allocate(pool.num_free)  # every free block: never an offloading one
    assert len(others) == 5 and {b.block_id for b in others}.isdisjoint(b.block_id for b in blocks)
    assert store.stats.num_backed_up == 0
    pool.release(others)

    drain(store)
    assert [b.ref_count for b in blocks] == [0, 0, 0]
    assert [store.state(x) for x in hashes] == [NodeState.ON_DEVICE] * 3
    assert store.stats.num_backed_up == 3 and host.num_used == 3
    for x in hashes:
        assert torch.equal(host.storage.blocks[host.lookup(x)], expected[x])
    evict_device(pool)
    assert [pool.lookup(x) for x in hashes] == [None] * 3
    assert [store.state(x) for x in hashes] == [NodeState.ON_HOST] * 3
    zero_device(kv)
    for x in hashes:
        assert torch.equal(tier_block(rig.store, x), expected[x])


def test_backup_skips_hashless_and_already_kept_blocks(make_rig: MakeRig) -> None:
    store, pool, _ = rig = make_rig(host_blocks=4)
    back_up(rig, [h(0)])
    again = publish(pool, [h(1)])
    (hashless,) = pool.allocate(1)
    store.backup([hashless, pool.lookup(h(0)), *again, *again])  # h(0) is on host, h(1) twice
    assert hashless.ref_count == 1 and pool.lookup(h(0)).ref_count == 0 and again[0].ref_count == 2
    drain(store)
    assert store.stats.num_backed_up == 2 and store.tiers[0].num_used == 2


def test_a_full_host_demotes_its_victims_to_disk(make_rig: MakeRig) -> None:
    store, pool, kv = make_rig(host_blocks=2, disk_blocks=4)
    host, disk = store.tiers
    assert (host.name, disk.name) == ("host", "disk")
    hashes = [h(i) for i in range(5)]
    blocks = publish(pool, hashes)
    expected = {x: device_block(kv, b.block_id) for x, b in zip(hashes, blocks)}
    for batch in ([0, 1], [2], [3, 4]):  # the last one evicts two host blocks at once
        store.backup([blocks[i] for i in batch])
        drain(store)
    assert store.stats.num_backed_up == 5 and store.stats.num_demoted == 3
    assert host.num_evictions == 3 and host.num_used == 2 and disk.num_used == 3
    pool.release(blocks)
    evict_device(pool)
    zero_device(kv)
    assert [store.state(x) for x in hashes] == [NodeState.ON_DISK] * 3 + [NodeState.ON_HOST] * 2
    for x in hashes:  # a demotion reads its host slot before the backup overwrites it
        assert torch.equal(tier_block(store, x), expected[x])


def test_without_a_disk_tier_the_host_victim_is_dropped(make_rig: MakeRig) -> None:
    store, pool, _ = rig = make_rig(host_blocks=2)
    expected = back_up(rig, [h(0), h(1)])
    expected |= back_up(rig, [h(2)])
    evict_device(pool)
    assert [store.state(h(i)) for i in range(3)] == [None, NodeState.ON_HOST, NodeState.ON_HOST]
    assert store.stats.num_demoted == 0 and store.match([h(0)]).entries == []
    assert torch.equal(tier_block(store, h(2)), expected[h(2)])


def test_a_disk_only_store_backs_up_to_disk(make_rig: MakeRig) -> None:
    store, pool, kv = rig = make_rig(host_blocks=0, disk_blocks=2)
    assert [t.name for t in store.tiers] == ["disk"]
    expected = back_up(rig, [h(0), h(1)])
    back_up(rig, [h(2)])  # evicts h(0): nowhere to demote it
    evict_device(pool)
    zero_device(kv)
    assert [store.state(h(i)) for i in range(3)] == [None, NodeState.ON_DISK, NodeState.ON_DISK]
    assert torch.equal(tier_block(store, h(1)), expected[h(1)])


def test_backups_beyond_free_host_slots_wait_in_the_backlog(make_rig: MakeRig) -> None:
    store, pool, kv = make_rig(host_blocks=2, disk_blocks=4)
    blocks = publish(pool, [h(0), h(1), h(2)])
    expected = {b.block_hash: device_block(kv, b.block_id) for b in blocks}
    store.backup(blocks)  # both host slots pending: h(2) has to wait for one to be evictable
    assert [b.ref_count for b in blocks] == [2, 2, 1]
    assert h(2) not in store.tiers[0]
    drain(store)
    assert store.stats.num_backed_up == 3 and store.stats.num_demoted == 1
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    for x, data in expected.items():
        assert torch.equal(tier_block(store, x), data)


def test_a_backlogged_block_evicted_from_the_device_is_not_backed_up(make_rig: MakeRig) -> None:
    store, pool, _ = make_rig(host_blocks=2)
    blocks = publish(pool, [h(0), h(1), h(2)])
    store.backup(blocks)
    pool.release(blocks[2:])
    assert blocks[2].ref_count == 0  # waiting does not pin
    evict_device(pool)  # h(2) leaves the device before a host slot frees up
    assert blocks[2].block_hash is None
    drain(store)
    assert store.stats.num_backed_up == 2 and h(2) not in store.tiers[0]
    assert store.state(h(2)) is None


# -- up: match, fetch, load ---------------------------------------------------------------

def test_match_returns_ready_entries_in_chain_order_up_to_the_first_miss(make_rig: MakeRig) -> None:
    store, pool, kv = rig = make_rig(host_blocks=2, disk_blocks=4)
    expected = back_up(rig, [h(0), h(1)])
    expected |= back_up(rig, [h(2)])  # h(0) goes down to disk
    found = store.match([h(0), h(1), h(2), h(9), h(1)])
    assert not found.loading
    assert [e.block_hash for e in found.entries] == [h(0), h(1), h(2)]
    assert [e.tier.name for e in found.entries] == ["disk", "host", "host"]
    assert store.match([h(9), h(0)]) == LowerMatch([], loading=False)
    assert store.match([]) == LowerMatch([], loading=False)

    fresh = pool.allocate(pool.num_free)  # evicts everything from the device
    zero_device(kv)
    targets = [fresh[5], fresh[2], fresh[7]]
    assert store.fetch(found.entries, targets) is True
    for x, block in zip([h(0), h(1), h(2)], targets):
        assert torch.equal(device_block(kv, block.block_id), expected[x])
    untouched = set(range(8)) - {b.block_id for b in targets}
    assert not any(device_block(kv, i).any() for i in untouched)
    assert store.stats.num_fetched == 3 and store.stats.fetch_seconds > 0
    pool.release(fresh)


def test_fetch_marks_entries_as_recently_used(make_rig: MakeRig) -> None:
    store, pool, _ = rig = make_rig(host_blocks=2)
    back_up(rig, [h(0), h(1)])  # host LRU: h(0), h(1)
    fresh = pool.allocate(1)
    assert store.fetch(store.match([h(0)]).entries, fresh)
    pool.release(fresh)
    back_up(rig, [h(2)])
    assert h(0) in store.tiers[0] and h(1) not in store.tiers[0]


def test_a_failed_fetch_drops_the_entries(make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch) -> None:
    store, pool, _ = rig = make_rig(host_blocks=2)
    back_up(rig, [h(0), h(1)])
    entries = store.match([h(0), h(1)]).entries

    def broken(*args: object) -> None:
        raise OSError("unreadable")

    monkeypatch.setattr(store_module, "tier_to_device", broken)
    fresh = pool.allocate(2)
    assert store.fetch(entries, fresh) is False
    assert store.stats.num_failed == 1 and store.stats.num_fetched == 0
    assert h(0) not in store.tiers[0] and store.tiers[0].num_used == 0


def _workflow_rig(make_rig: MakeRig) -> tuple[Rig, WorkflowTable, WorkflowPolicy]:
    table = WorkflowTable()
    policy = WorkflowPolicy(table)
    return make_rig(host_blocks=4, policy=policy), table, policy


PREFIX = tuple(h(i) for i in range(4))


def _prefix_off_device(rig: Rig) -> dict[bytes, torch.Tensor]:
    """PREFIX backed up to the host, then evicted from the device, which is zeroed."""
    expected = back_up(rig, list(PREFIX))
    evict_device(rig.pool)
    zero_device(rig.kv)
    assert [rig.store.state(x) for x in PREFIX] == [NodeState.ON_HOST] * 4
    return expected


def test_load_brings_a_prefix_back_and_nothing_evicts_it_meanwhile(make_rig: MakeRig) -> None:
    rig, table, policy = _workflow_rig(make_rig)
    store, pool, kv = rig
    table.observe(AgentKey("app", "a"), PREFIX, {"a": 0})
    expected = _prefix_off_device(rig)
    host = store.tiers[0]

    assert store.load(PREFIX, lambda x: policy.spares(x, 0), num_reserved=2) == 4
    assert [store.state(x) for x in PREFIX] == [NodeState.LOADING] * 4
    assert store.match(list(PREFIX)) == LowerMatch([], loading=True)
    assert store.match([h(9)]) == LowerMatch([], loading=False)
    assert [pool.lookup(x) for x in PREFIX] == [None] * 4  # not published before it lands
    assert store.num_loads_in_flight == 1 and pool.num_free == 4
    assert store.load(PREFIX, lambda x: True, num_reserved=0) == 0  # already on its way
    others = pool.allocate(pool.num_free)  # no node is evicted while loading
    with pytest.raises(MemoryError):
        pool.allocate(1)
    for i, block in enumerate(others):  # new blocks to back up: the host is full of pinned ones
        pool.register(block, h(50 + i))
    store.backup(others)
    assert all(h(50 + i) not in host for i in range(4)) and host.num_evictions == 0

    drain(store)
    loaded = [pool.lookup(x) for x in PREFIX]
    assert None not in loaded
    assert {b.block_id for b in loaded}.isdisjoint(b.block_id for b in others)
    assert [b.ref_count for b in loaded] == [0] * 4
    assert [store.state(x) for x in PREFIX] == [NodeState.ON_DEVICE] * 4
    for x, block in zip(PREFIX, loaded):
        assert torch.equal(device_block(kv, block.block_id), expected[x])
    assert store.stats.num_prefetched == 4 and store.num_loads_in_flight == 0
    assert all(h(50 + i) in host for i in range(4))  # the slots were unpinned: the backlog got in
    pool.release(others)


def test_load_leaves_num_reserved_blocks_free(make_rig: MakeRig) -> None:
    rig = _workflow_rig(make_rig)[0]
    store, pool, _ = rig
    _prefix_off_device(rig)
    assert store.load(PREFIX, lambda x: True, num_reserved=6) == 2  # 8 free, 6 kept
    assert [store.state(x) for x in PREFIX] == [NodeState.LOADING] * 2 + [NodeState.ON_HOST] * 2
    assert pool.num_free == 6
    drain(store)
    assert [store.state(x) for x in PREFIX] == [NodeState.ON_DEVICE] * 2 + [NodeState.ON_HOST] * 2
    assert store.load(PREFIX, lambda x: True, num_reserved=8) == 0
    assert store.load(PREFIX, lambda x: True, num_reserved=0) == 2  # only what is still off the device


def test_load_takes_only_blocks_the_policy_spares(make_rig: MakeRig) -> None:
    rig, table, policy = _workflow_rig(make_rig)
    store, pool, _ = rig
    near = tuple(h(70 + i) for i in range(5))
    table.observe(AgentKey("app", "near"), near, {"near": 0, "far": 3})
    table.observe(AgentKey("app", "far"), PREFIX, None)
    _prefix_off_device(rig)
    blocks = publish(pool, [*near, h(80)])  # 5 blocks of the nearer agent's prefix, 1 suffix, 2 empty
    pool.release(blocks)
    assert store.load(PREFIX, lambda x: policy.spares(x, 3), num_reserved=0) == 3
    assert all(pool.lookup(x) is not None for x in near)  # never a nearer agent's prefix
    assert pool.lookup(h(80)) is None  # a suffix is fair game
    drain(store)
    assert [store.state(x) for x in PREFIX] == [NodeState.ON_DEVICE] * 3 + [NodeState.ON_HOST]


def test_load_stops_where_the_chain_breaks(make_rig: MakeRig) -> None:
    rig = _workflow_rig(make_rig)[0]
    store, pool, _ = rig
    _prefix_off_device(rig)
    assert store.load((h(0), h(99), h(1)), lambda x: True, num_reserved=0) == 1
    drain(store)
    assert store.state(h(0)) is NodeState.ON_DEVICE and store.state(h(1)) is NodeState.ON_HOST
    assert store.load((h(0), h(1)), lambda x: True, num_reserved=0) == 1  # h(0) is on the device already
    drain(store)
    assert store.state(h(1)) is NodeState.ON_DEVICE


def test_load_with_nothing_to_bring_back_walks_no_free_block(make_rig: MakeRig,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetcher asks every step; a prefix already on the device (or nowhere below)
    must cost a lookup per block, not a walk of the free list through the policy."""
    rig = _workflow_rig(make_rig)[0]
    store, pool, _ = rig

    def walked(spares: Callable[[bytes | None], bool]) -> int:
        raise AssertionError("count_free walked the free list for nothing")

    publish(pool, [h(0), h(1)])
    monkeypatch.setattr(pool, "count_free", walked)
    assert store.load((h(0), h(1)), lambda x: True, num_reserved=0) == 0  # on the device
    assert store.load((h(98), h(99)), lambda x: True, num_reserved=0) == 0  # in no tier


def test_load_with_lru_takes_only_empty_blocks(make_rig: MakeRig) -> None:
    store, pool, _ = rig = make_rig(host_blocks=4)
    _prefix_off_device(rig)
    cached = publish(pool, [h(60 + i) for i in range(4)])
    empty = pool.allocate(4)
    pool.release(cached)  # least recently freed: LRU's first victims
    pool.release(empty)
    assert pool.count_free(lambda x: x is None) == 4
    lru = LruPolicy()
    assert store.load(PREFIX, lambda x: lru.spares(x, 0), num_reserved=0) == 4
    assert all(pool.lookup(h(60 + i)) is not None for i in range(4))


# -- failures ---------------------------------------------------------------------------------

def test_a_failed_load_publishes_nothing_and_frees_its_blocks(make_rig: MakeRig,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rig = _workflow_rig(make_rig)[0]
    store, pool, _ = rig
    _prefix_off_device(rig)

    def broken(*args: object) -> None:
        raise OSError("unreadable")

    monkeypatch.setattr(store_module, "tier_to_device", broken)
    assert store.load(PREFIX, lambda x: True, num_reserved=0) == 4
    assert pool.num_free == 4
    drain(store)
    assert [pool.lookup(x) for x in PREFIX] == [None] * 4
    assert pool.num_free == 8 and all(b.ref_count == 0 and b.block_hash is None for b in pool.blocks)
    assert store.stats.num_failed == 1 and store.stats.num_prefetched == 0
    assert store.num_loads_in_flight == 0
    assert [store.state(x) for x in PREFIX] == [None] * 4  # unreadable: dropped, recomputed when needed
    assert store.tiers[0].num_used == 0


def test_a_failed_backup_keeps_nothing_and_unpins(make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch) -> None:
    store, pool, kv = make_rig(host_blocks=2)
    real = store_module.device_to_tier
    calls: list[int] = []

    def fails_once(*args: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk full")
        real(*args)

    monkeypatch.setattr(store_module, "device_to_tier", fails_once)
    blocks = publish(pool, [h(0)])
    pool.release(blocks)
    store.backup(blocks)
    assert blocks[0].ref_count == 1
    drain(store)
    assert blocks[0].ref_count == 0 and h(0) not in store.tiers[0] and store.tiers[0].num_used == 0
    assert store.stats.num_failed == 1 and store.stats.num_backed_up == 0
    assert store.state(h(0)) is NodeState.ON_DEVICE
    store.backup(blocks)  # the worker survived: a retry lands
    drain(store)
    assert store.stats.num_backed_up == 1
    assert torch.equal(tier_block(store, h(0)), device_block(kv, blocks[0].block_id))


def test_a_failed_demotion_drops_the_victim(make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch) -> None:
    store, pool, _ = rig = make_rig(host_blocks=1, disk_blocks=2)
    back_up(rig, [h(0)])

    def broken(*args: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(store_module, "tier_to_tier", broken)
    back_up(rig, [h(1)])
    evict_device(pool)
    assert store.stats.num_failed == 1 and store.stats.num_demoted == 0
    assert store.state(h(0)) is None and store.tiers[1].num_used == 0
    assert store.state(h(1)) is NodeState.ON_HOST


# -- budgets and shutdown ----------------------------------------------------------------------

def _tier_budgets_hold(store: TieredStore, pool: BlockPool) -> None:
    for tier in store.tiers:
        assert 0 <= tier.num_used <= tier.num_blocks
    assert pool.num_free <= pool.num_blocks and pool.num_cached <= pool.num_blocks
    assert len(pool.blocks) == 8


def test_budgets_hold_under_churn_and_every_kept_block_is_exact(make_rig: MakeRig) -> None:
    store, pool, kv = make_rig(host_blocks=3, disk_blocks=5)
    expected: dict[bytes, torch.Tensor] = {}
    for i in range(40):
        (block,) = pool.allocate(1)  # never a block being offloaded
        randomize(kv, block.block_id, seed=i)
        pool.register(block, h(i))
        expected[h(i)] = device_block(kv, block.block_id)
        store.backup([block])
        pool.release([block])
        if i % 3 == 2:
            store.poll()  # no waiting: copies pile up behind one another
        _tier_budgets_hold(store, pool)
    drain(store)
    _tier_budgets_hold(store, pool)
    kept = [x for x in expected if store.match([x]).entries]
    assert len(kept) == 8  # both tiers full
    assert store.tiers[0].num_used == 3 and store.tiers[1].num_used == 5
    for x in kept:
        assert torch.equal(tier_block(store, x), expected[x])
    assert all(b.ref_count == 0 for b in pool.blocks)


def _store_with(config: TierConfig) -> TieredStore:
    kv = KVCache(MODEL, EngineConfig(kv_cache_bytes=8 * BLOCK_BYTES, block_size=BS))
    return TieredStore(config, BlockPool(kv.num_blocks), kv, LruPolicy())


def test_too_small_host_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="host tier"):
        _store_with(TierConfig(host_bytes=BLOCK_BYTES - 1))


def test_too_small_disk_budget_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk tier"):
        _store_with(TierConfig(disk_path=str(tmp_path), disk_bytes=BLOCK_BYTES - 1))


def test_close_stops_the_worker_after_applying_finished_transfers(make_rig: MakeRig) -> None:
    store, pool, _ = make_rig(host_blocks=4)
    blocks = publish(pool, [h(0), h(1)])
    pool.release(blocks)
    store.backup(blocks)
    thread = store.worker._thread
    assert thread.is_alive()
    store.close()
    assert not thread.is_alive()
    assert store.stats.num_backed_up == 2 and store.worker.num_in_flight == 0
    assert [b.ref_count for b in blocks] == [0, 0]


def test_close_leaves_nothing_in_flight_when_backups_were_waiting(make_rig: MakeRig) -> None:
    store, pool, _ = make_rig(host_blocks=2)
    blocks = publish(pool, [h(0), h(1), h(2)])
    pool.release(blocks)
    store.backup(blocks)  # h(2) waits for a host slot
    store.close()
    assert store.worker.num_in_flight == 0
    assert [b.ref_count for b in blocks] == [0, 0, 0]
    assert store.state(h(2)) is not NodeState.OFFLOADING


def test_the_worker_rings_its_driver_as_each_transfer_lands(make_rig: MakeRig) -> None:
    """A driver sleeping on its own queue (AsyncEngine) is woken by each landed copy."""
    store, pool, _ = make_rig(host_blocks=4)
    rings: list[int] = []
    store.worker.notify = lambda: rings.append(store.worker.num_in_flight)
    blocks = publish(pool, [h(0), h(1)])
    store.backup(blocks[:1])
    store.backup(blocks[1:])
    drain(store)
    assert len(rings) == 2  # one per transfer, rung after it was queued as done
    pool.release(blocks[::-1])
