"""WorkflowPolicy vs LruPolicy: which blocks a real BlockPool evicts first, and what a prefetch may take."""

from __future__ import annotations

import math

import pytest

from engine_ext.kv.block_pool import BlockPool
from engine_ext.kv.eviction import EvictionPolicy, LruPolicy
from engine_ext.tiers.policy import WorkflowPolicy
from engine_ext.tiers.workflow import AgentKey, WorkflowTable


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


A, B, C, U = (AgentKey("app", n) for n in ("a", "b", "c", "u"))

# block id -> hash it holds (None: an empty block)
CONTENTS: dict[int, bytes | None] = {
    0: None,  # empty
    1: h(100),  # a varying suffix: in no prefix
    2: h(101),  # another suffix
    3: h(1),  # A's prefix (steps 1)
    4: h(5),  # B's prefix (steps 5)
    5: h(6),  # C's prefix (steps 5)
    6: h(9),  # U's prefix (steps unknown)
    7: h(2),  # shared by A (1) and B (5): priority 1
}
RELEASE_ORDER = [5, 3, 1, 7, 4, 0, 6, 2]  # least recently freed first
WORKFLOW_ORDER = [0, 1, 2, 6, 5, 4, 3, 7]  # empty, suffixes (LRU), inf, 5s (LRU), 1s (LRU)


def make_table() -> WorkflowTable:
    table = WorkflowTable()
    table.observe(A, (h(2), h(1)), {"a": 1, "b": 5, "c": 5})
    table.observe(B, (h(2), h(5)), None)
    table.observe(C, (h(6),), None)
    table.observe(U, (h(9),), None)  # u is in no plan: infinitely far
    return table


def make_pool(policy: EvictionPolicy) -> BlockPool:
    """Every block cached with CONTENTS and freed in RELEASE_ORDER."""
    pool = BlockPool(len(CONTENTS), policy=policy)
    blocks = pool.allocate(len(CONTENTS))
    for block in blocks:
        if (block_hash := CONTENTS[block.block_id]) is not None:
            pool.register(block, block_hash)
    for block_id in RELEASE_ORDER:
        pool.release([blocks[block_id]])
    return pool


def test_table_priorities_behind_the_scenario() -> None:
    table = make_table()
    assert [table.priority(CONTENTS[i]) for i in range(1, 8)] == [None, None, 1, 5, 5, math.inf, 1]


def test_workflow_policy_eviction_order() -> None:
    pool = make_pool(WorkflowPolicy(make_table()))
    got = pool.allocate(len(CONTENTS))
    assert [b.block_id for b in got] == WORKFLOW_ORDER
    assert pool.num_evictions == 7 and pool.num_cached == 0


def test_workflow_policy_evicts_step_by_step_in_the_same_order() -> None:
    pool = make_pool(WorkflowPolicy(make_table()))
    got = [pool.allocate(1)[0].block_id for _ in range(len(CONTENTS))]
    assert got == WORKFLOW_ORDER


def test_a_partial_allocation_keeps_the_nearest_prefixes_cached() -> None:
    pool = make_pool(WorkflowPolicy(make_table()))
    got = pool.allocate(5)
    assert [b.block_id for b in got] == WORKFLOW_ORDER[:5]
    for block_id in WORKFLOW_ORDER[5:]:
        assert pool.lookup(CONTENTS[block_id]).block_id == block_id
    for block_id in WORKFLOW_ORDER[1:5]:
        assert pool.lookup(CONTENTS[block_id]) is None


def test_lru_policy_keeps_the_least_recently_freed_order() -> None:
    pool = make_pool(LruPolicy())
    assert [b.block_id for b in pool.allocate(len(CONTENTS))] == RELEASE_ORDER


def test_the_policy_follows_the_table_live() -> None:
    table = make_table()
    pool = make_pool(WorkflowPolicy(table))
    table.finished(A)  # A just ran: 6 steps away; h(2) is still B's (5), h(1) is A's alone
    # (2, -6) for block 3 now goes before the 5s; block 7 (shared, min 5) joins them, LRU among equals
    assert [b.block_id for b in pool.allocate(len(CONTENTS))] == [0, 1, 2, 6, 3, 5, 7, 4]


@pytest.mark.parametrize("policy", [LruPolicy(), WorkflowPolicy(make_table())], ids=["lru", "workflow"])
def test_pinned_blocks_are_never_chosen(policy: EvictionPolicy) -> None:
    """A block with a reference (loading or offloading, or in use) is out of reach of every policy."""
    pool = make_pool(policy)
    pinned = [pool.blocks[0], pool.blocks[5], pool.blocks[6]]  # workflow's 1st, LRU's 1st, the inf prefix
    for block in pinned:
        pool.touch(block)
    got = pool.allocate(pool.num_free)
    assert len(got) == len(CONTENTS) - len(pinned)
    assert not {b.block_id for b in got} & {b.block_id for b in pinned}
    with pytest.raises(MemoryError):
        pool.allocate(1)
    assert pool.lookup(h(6)) is pinned[1] and pool.lookup(h(9)) is pinned[2]


def test_never_released_blocks_are_never_chosen() -> None:
    pool = BlockPool(4, policy=WorkflowPolicy(make_table()))
    held = pool.allocate(2)  # never released
    pool.register(held[0], h(100))  # the policy's favourite victim, if it were free
    got = pool.allocate(2)
    assert {b.block_id for b in got}.isdisjoint(b.block_id for b in held)
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_workflow_spares() -> None:
    table = make_table()
    policy = WorkflowPolicy(table)
    assert policy.spares(None, 0)
    assert policy.spares(h(100), 0)  # no priority: a suffix
    assert policy.spares(h(1), 0)  # priority 1 > 0
    assert not policy.spares(h(1), 1)  # equal: the agent needs it as soon
    assert not policy.spares(h(1), 4)
    assert policy.spares(h(5), 4) and not policy.spares(h(5), 5)
    assert not policy.spares(h(2), 3)  # shared: A's 1 counts, not B's 5
    assert policy.spares(h(9), 64)  # unknown steps: infinitely far


def test_spares_agrees_with_the_eviction_order() -> None:
    """What spares(·, steps) lets go is exactly the policy's first victims (a prefetch may take them)."""
    pool = make_pool(WorkflowPolicy(make_table()))
    policy = pool.policy
    for steps in (0, 1, 4, 5, 64):
        num = pool.count_free(lambda bh: policy.spares(bh, steps))
        assert num == sum(policy.spares(CONTENTS[i], steps) for i in WORKFLOW_ORDER)
        assert all(policy.spares(CONTENTS[i], steps) for i in WORKFLOW_ORDER[:num])
        assert not any(policy.spares(CONTENTS[i], steps) for i in WORKFLOW_ORDER[num:])


def test_lru_spares_only_empty_blocks() -> None:
    policy = LruPolicy()
    assert policy.spares(None, 0)
    assert not policy.spares(h(100), math.inf)
