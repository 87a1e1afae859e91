"""SegmentIndex tails: an entry is found by its tokens less its first few, as a new entry
whose KV is the entry's rows moved back to position 0 (an answer quoted inline after a
name, whose first word tokenizes differently there)."""

from __future__ import annotations

import pytest
import torch

from engine_ext.config import EngineConfig, ModelConfig
from engine_ext.kv.block_pool import BlockPool
from engine_ext.kv.cache import KVCache
from engine_ext.kv.segment_index import MAX_TAIL_DROP, SegmentIndex
from engine_ext.rope import RopeShifter

BLOCK = 4
ANSWER = tuple(range(10, 30))  # 20 tokens


def make_index(num_blocks: int = 32) -> SegmentIndex:
    model = ModelConfig(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
                        tie_word_embeddings=False, qkv_bias=False, qk_norm=False)
    kv_cache = KVCache(model, EngineConfig(kv_cache_bytes=num_blocks * BLOCK * model.kv_bytes_per_token(4),
                                           block_size=BLOCK))
    return SegmentIndex(BlockPool(kv_cache.num_blocks), kv_cache, RopeShifter.for_model(model), "test")


def register_answer(index: SegmentIndex, position: int = 7, tenant: str = "t") -> torch.Tensor:
    """Register ANSWER from random KV computed at `position`; returns that KV's keys, layer 0."""
    blocks = index.pool.allocate(-(-len(ANSWER) // BLOCK))
    ids = torch.tensor([b.block_id for b in blocks])
    slots = (ids[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).flatten()[: len(ANSWER)]
    gen = torch.Generator().manual_seed(0)
    for k, v in index.kv_cache.layers:
        k[slots] = torch.randn(len(ANSWER), *k.shape[1:], generator=gen)
        v[slots] = torch.randn(len(ANSWER), *v.shape[1:], generator=gen)
    assert index.register(list(ANSWER), slots, position, tenant)
    index.pool.release(blocks)
    return index.kv_cache.layers[0][0][slots].clone()


@pytest.mark.parametrize("dropped", range(1, MAX_TAIL_DROP + 1))
def test_a_tail_is_found_as_an_entry_of_its_own_with_the_rows_moved_to_position_zero(dropped: int):
    index = make_index()
    register_answer(index)
    full = index.lookup(ANSWER, "t")
    tail = index.lookup(ANSWER[dropped:], "t")
    assert full is not None and tail is not None and tail.token_ids == ANSWER[dropped:]
    assert tail.key != full.key
    k_full = index.kv_cache.layers[0][0][index.slots(full)[dropped:]]
    v_full = index.kv_cache.layers[0][1][index.slots(full)[dropped:]]
    k_tail = index.kv_cache.layers[0][0][index.slots(tail)]
    assert torch.equal(index.kv_cache.layers[0][1][index.slots(tail)], v_full)  # values move as they are
    # keys: the full entry's row `dropped` sits at canonical position `dropped`, the tail's at 0
    assert torch.allclose(index.shifter.shift(k_full, -dropped), k_tail, atol=1e-5)
    assert index.lookup(ANSWER[dropped:], "t") == tail  # made once, found after


def test_a_tail_is_not_found_for_another_tenant_beyond_the_bound_or_after_eviction():
    index = make_index()
    register_answer(index)
    assert index.lookup(ANSWER[1:], "other") is None
    assert index.lookup(ANSWER[MAX_TAIL_DROP + 1:], "t") is None
    assert index.lookup(ANSWER[1:-1], "t") is None  # a tail, not any inner piece
    full = index.peek(ANSWER, "t")
    assert full is not None
    index.blobs.discard(full.blob)
    assert index.lookup(ANSWER[1:], "t") is None
