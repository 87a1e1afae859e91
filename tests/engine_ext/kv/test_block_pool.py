from __future__ import annotations

import pytest

from engine_ext.kv.block_pool import BlockPool


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_fresh_pool():
    pool = BlockPool(4)
    assert pool.num_blocks == 4
    assert pool.num_free == 4
    assert pool.num_cached == 0
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_sets_refcount_and_consumes_free():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free == 1
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing


def test_release_returns_blocks_and_refcounts():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.touch(a)  # a second holder
    assert a.ref_count == 2
    pool.release([a, b])
    assert (a.ref_count, b.ref_count) == (1, 0)
    assert pool.num_free == 2
    pool.release([a])
    assert a.ref_count == 0
    assert pool.num_free == 3


def test_release_more_than_taken_raises():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(RuntimeError):
        pool.release([a])
    assert a.ref_count == 0
    assert pool.num_free == 2


def test_register_and_lookup():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    assert pool.lookup(h(1)) is a
    assert a.block_hash == h(1)
    assert pool.lookup(h(2)) is None
    assert pool.num_cached == 1
    # the same content in another block: the first stays canonical
    pool.register(b, h(1))
    assert pool.lookup(h(1)) is a
    assert b.block_hash is None
    # a block already registered keeps its hash
    pool.register(a, h(3))
    assert a.block_hash == h(1)
    assert pool.lookup(h(3)) is None


def test_cached_blocks_survive_release_until_evicted():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    pool.release([b, a])
    assert pool.num_free == 2
    assert pool.lookup(h(1)) is a  # still reusable while it sits in the LRU
    (x,) = pool.allocate(1)  # b was freed first -> it goes first; a survives
    assert x is b
    assert pool.lookup(h(1)) is a
    assert pool.num_evictions == 0
    (y,) = pool.allocate(1)
    assert y is a
    assert pool.lookup(h(1)) is None
    assert a.block_hash is None
    assert pool.num_cached == 0
    assert pool.num_evictions == 1


def test_lru_evicts_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks):
        pool.register(blk, h(i))
    # free in the order 2, 0, 3, 1
    for idx in (2, 0, 3, 1):
        pool.release([blocks[idx]])
    got = [pool.allocate(1)[0].block_id for _ in range(4)]
    assert got == [2, 0, 3, 1]
    assert pool.num_evictions == 4


def test_hit_pulls_block_out_of_lru():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.register(blk, h(i))
    pool.release(blocks)  # LRU order 0, 1, 2
    assert pool.num_free == 3
    hit = pool.lookup(h(0))
    pool.touch(hit)  # revive the oldest: it must not be handed out now
    assert hit.ref_count == 1
    assert pool.num_free == 2
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [1, 2]
    with pytest.raises(MemoryError):
        pool.allocate(1)
    assert pool.lookup(h(0)) is hit  # the hit kept its hash
    # freed again, it becomes the most recently freed
    pool.release(got)
    pool.release([hit])
    assert [pool.allocate(1)[0].block_id for _ in range(3)] == [1, 2, 0]


def test_touch_on_referenced_block_only_increments():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.register(a, h(9))
    free_before = pool.num_free
    pool.touch(a)
    assert a.ref_count == 2
    assert pool.num_free == free_before


def test_reset_cache_forgets_hashes():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    pool.register(b, h(2))
    pool.reset_cache()
    assert pool.num_cached == 0
    assert pool.lookup(h(1)) is None
    assert a.block_hash is None
    pool.release([a, b])
    pool.allocate(3)
    assert pool.num_evictions == 0
