"""CacheMap: the blocks a prompt is predicted to start with, and which replica holds them."""

from __future__ import annotations

from kvrelay.gateway.routing.cache_map import CacheMap, ReplicaBlocks
from kvrelay.gateway.routing.prefix_keys import PrefixKey
from kvrelay.wire.cache_report import CacheReport

BLOCKS = [f"{i:016x}" for i in range(10)]


def keys(*chars: int) -> list[PrefixKey]:
    return [PrefixKey(bytes([i]) * 16, c) for i, c in enumerate(chars)]


def test_a_prompt_extending_a_reported_one_is_predicted_to_start_with_its_blocks():
    cache = CacheMap()
    cache.learn(keys(100, 1000), BLOCKS)
    assert cache.predict(keys(100, 1000, 1500)) == BLOCKS  # the longest known prefix: all ten
    assert cache.predict(keys(100)) == BLOCKS[:1]  # a tenth of the characters: a tenth of the blocks
    assert cache.predict([PrefixKey(b"z" * 16, 100)]) == []


def test_learning_nothing_changes_nothing_and_the_table_is_bounded():
    cache = CacheMap(max_prompts=3)
    cache.learn([], BLOCKS)
    cache.learn(keys(10), [])
    assert cache.predict(keys(10)) == []
    for n in range(5):
        cache.learn([PrefixKey(bytes([n]) * 16, 10)], BLOCKS)
    assert len(cache._prompts) == 3
    assert cache.predict([PrefixKey(bytes([0]) * 16, 10)]) == []  # the oldest went first


def test_a_replica_holds_a_prefix_run_weighted_by_tier():
    replica = ReplicaBlocks(max_blocks=100, lower_weight=0.5)
    replica.replace(CacheReport(block_size=16, device=BLOCKS[:3], lower=BLOCKS[3:5]))
    assert replica.hit_tokens(BLOCKS) == (3 + 2 * 0.5) * 16  # stops at the first block it lacks
    assert replica.hit_tokens(BLOCKS[1:]) == (2 + 1) * 16
    assert replica.hit_tokens(["f" * 16] + BLOCKS) == 0
    replica.replace(CacheReport(block_size=32, device=BLOCKS[:1]))  # a new report replaces the table
    assert replica.hit_tokens(BLOCKS) == 32


def test_blocks_added_between_reports_count_and_stay_bounded():
    replica = ReplicaBlocks(max_blocks=4, lower_weight=0.5)
    replica.add(BLOCKS[:6])
    assert len(replica) == 4 and replica.hit_tokens(BLOCKS) == 0  # the first two aged out
    assert replica.hit_tokens(BLOCKS[2:]) == 4 * 16
