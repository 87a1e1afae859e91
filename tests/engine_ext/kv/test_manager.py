from __future__ import annotations

import pytest
import torch

from engine_ext.detokenizer import Detokenizer
from engine_ext.kv.hashing import block_hashes, namespace_root
from engine_ext.kv.manager import KVCacheManager
from engine_ext.sampling import SamplingParams
from engine_ext.sequence import Sequence

BS = 4


class _Dec:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4), 4, Detokenizer(_Dec()))


def compute(mgr: KVCacheManager, s: Sequence, n: int | None = None) -> None:
    """What a step does: allocate, pretend the tokens were computed, publish."""
    n = s.num_uncomputed if n is None else n
    prefix = mgr.match_prefix(s) if s.num_computed_tokens == 0 and not s.blocks else None
    if prefix is not None:
        n = min(n, s.num_tokens - prefix.num_cached_tokens)
    assert mgr.allocate(s, n, prefix)
    mgr.computed(s, s.num_computed_tokens + n)
    mgr.publish(s)


def test_num_blocks_for():
    mgr = KVCacheManager(8, BS, "m")
    assert [mgr.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_match_prefix_on_empty_cache():
    mgr = KVCacheManager(8, BS, "m")
    s = seq(range(10))
    m = mgr.match_prefix(s)
    assert m.blocks == [] and m.num_cached_tokens == 0
    assert s.block_hashes == block_hashes(namespace_root("m"), list(range(10)), BS)


def test_publish_registers_full_computed_blocks_only():
    mgr = KVCacheManager(8, BS, "m")
    s = seq(range(10))
    assert mgr.allocate(s, 6)
    assert len(s.blocks) == 2
    s.num_computed_tokens = 6  # block 0 full and computed; block 1 half
    mgr.publish(s)
    assert mgr.pool.num_cached == 1
    hashes = block_hashes(namespace_root("m"), list(range(10)), BS)
    assert mgr.pool.lookup(hashes[0]) is s.blocks[0]
    assert mgr.pool.lookup(hashes[1]) is None
    assert mgr.allocate(s, 4)
    s.num_computed_tokens = 10
    mgr.publish(s)
    assert mgr.pool.num_cached == 2  # blocks 0, 1; block 2 has 2 of 4 tokens
    assert mgr.pool.lookup(hashes[1]) is s.blocks[1]
    assert s.num_published_blocks == 2


def test_publish_hashes_generated_tokens_too():
    mgr = KVCacheManager(8, BS, "m")
    s = seq(range(6))
    compute(mgr, s)
    s.token_ids += [50, 51]  # two generated tokens, then computed
    assert mgr.allocate(s, 2)
    s.num_computed_tokens = 8
    mgr.publish(s)
    hashes = block_hashes(namespace_root("m"), list(range(6)) + [50, 51], BS)
    assert mgr.pool.lookup(hashes[1]) is s.blocks[1]


def test_prefix_hit_and_cap_leaves_one_token_to_compute():
    mgr = KVCacheManager(8, BS, "m")
    a = seq(range(12), "a")
    compute(mgr, a)
    assert mgr.pool.num_cached == 3
    a_ids = [blk.block_id for blk in a.blocks]
    mgr.free(a)
    # exactly the same 12 tokens: only 2 of 3 blocks may be reused (the last token's logits are needed)
    b = seq(range(12), "b")
    m = mgr.match_prefix(b)
    assert m.num_cached_tokens == 8
    assert [blk.block_id for blk in m.blocks] == a_ids[:2]
    # 13 tokens: all 3 blocks
    c = seq(list(range(12)) + [99], "c")
    assert mgr.match_prefix(c).num_cached_tokens == 12
    # diverging inside block 1: only block 0
    d = seq([0, 1, 2, 3, 4, 77, 6, 7, 8, 9], "d")
    assert mgr.match_prefix(d).num_cached_tokens == 4
    # another namespace: nothing
    other = KVCacheManager(8, BS, "other")
    other.pool = mgr.pool
    assert other.match_prefix(seq(range(12))).num_cached_tokens == 0


def test_allocate_with_prefix_shares_blocks():
    mgr = KVCacheManager(8, BS, "m")
    a = seq(range(12), "a")
    compute(mgr, a)  # a still holds its 3 blocks
    b = seq(list(range(8)) + [40, 41, 42], "b")
    m = mgr.match_prefix(b)
    assert m.num_cached_tokens == 8
    free_before = mgr.pool.num_free
    assert mgr.allocate(b, 3, m)
    assert b.blocks[:2] == a.blocks[:2]
    assert a.blocks[0].ref_count == 2
    assert b.num_computed_tokens == 8
    assert mgr.pool.num_free == free_before - 1
    assert mgr.num_hit_tokens == 8
    mgr.free(a)
    mgr.free(b)
    assert mgr.pool.num_free == 8
    assert all(blk.ref_count == 0 for blk in mgr.pool.blocks)


def test_allocate_returns_false_without_changing_state():
    mgr = KVCacheManager(4, BS, "m")
    a = seq(range(12), "a")
    assert mgr.allocate(a, 12)  # 3 of 4 blocks
    b = seq(range(100, 108), "b")  # needs 2
    state = (mgr.pool.num_free, list(b.blocks), b.num_computed_tokens,
             [blk.ref_count for blk in mgr.pool.blocks])
    assert not mgr.allocate(b, 8)
    assert state == (mgr.pool.num_free, list(b.blocks), b.num_computed_tokens,
                     [blk.ref_count for blk in mgr.pool.blocks])
    assert mgr.allocate(b, 4)


def test_allocate_counts_revived_hits_against_free_blocks():
    """A cached hit sitting unreferenced in the LRU consumes a free block when taken."""
    mgr = KVCacheManager(4, BS, "m")
    a = seq(range(8), "a")
    compute(mgr, a)
    mgr.free(a)  # 2 cached blocks in the LRU, 4 free in all
    filler = seq(range(200, 204), "f")
    assert mgr.allocate(filler, 4)  # takes an uncached block; 3 free (2 of them cached)
    assert mgr.pool.num_free == 3
    b = seq(list(range(8)) + list(range(50, 58)), "b")  # 16 tokens: hits 2 blocks, needs 2 more
    m = mgr.match_prefix(b)
    assert m.num_cached_tokens == 8
    refs = [blk.ref_count for blk in mgr.pool.blocks]
    assert not mgr.allocate(b, 8, m)  # 2 revived + 2 new > 3 free
    assert [blk.ref_count for blk in mgr.pool.blocks] == refs
    assert b.blocks == [] and b.num_computed_tokens == 0
    assert mgr.pool.num_cached == 2
    mgr.free(filler)
    assert mgr.allocate(b, 8, m)
    assert b.num_computed_tokens == 8
    assert len(b.blocks) == 4


def test_slots_follow_block_table():
    mgr = KVCacheManager(8, BS, "m")
    filler = seq(range(4), "f")
    assert mgr.allocate(filler, 8)  # blocks 0, 1
    s = seq(range(10))
    assert mgr.allocate(s, 10)  # blocks 2, 3, 4
    ids = [blk.block_id for blk in s.blocks]
    slots = mgr.slots(s, 10)
    expected = [ids[i // BS] * BS + i % BS for i in range(10)]
    assert slots.tolist() == expected
    assert slots.dtype == torch.long
    assert mgr.slots(s, 5).tolist() == expected[:5]


def test_free_releases_tail_first():
    mgr = KVCacheManager(6, BS, "m")
    s = seq(range(12))
    compute(mgr, s)
    ids = [blk.block_id for blk in s.blocks]
    mgr.free(s)
    assert s.blocks == []
    # the tail block is evicted first, the head (most shareable) last
    got = [mgr.pool.allocate(1)[0].block_id for _ in range(6)]
    assert got[-3:] == list(reversed(ids))


def test_computed_tokens_only_grow_within_the_blocks_and_reset_frees_them():
    mgr = KVCacheManager(8, BS, "m")
    s = seq(range(10))
    assert mgr.allocate(s, 10)
    mgr.computed(s, 6)
    with pytest.raises(ValueError, match="do not fit"):
        mgr.computed(s, 13)  # three blocks hold 12 tokens
    with pytest.raises(ValueError):
        mgr.computed(s, 5)  # a count never goes back while the blocks are held
    mgr.computed(s, 10)
    mgr.publish(s)
    mgr.free(s)  # finished: its blocks go back, its count stays as a record
    assert (s.blocks, s.num_computed_tokens, mgr.pool.num_free) == ([], 10, 8)
    again = seq(range(10), "again")
    compute(mgr, again)
    mgr.reset(again)  # preempted: it starts over
    assert (again.blocks, again.num_computed_tokens, again.num_published_blocks) == ([], 0, 0)
    assert mgr.pool.num_free == 8
