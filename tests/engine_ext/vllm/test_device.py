"""DeviceOrder: KVFlow's order over vLLM's free queue. A minimal pool stands in for
vLLM's BlockPool (the real one is exercised in tests/gateway/vllm)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_ext.tiers.workflow import AgentKey, WorkflowTable
from engine_ext.vllm.device import DeviceOrder


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0


class Queue:
    def __init__(self, blocks: list[Block]) -> None:
        self.blocks = list(blocks)

    def remove(self, block: Block) -> None:
        self.blocks.remove(block)

    def append(self, block: Block) -> None:
        self.blocks.append(block)

    def ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class Pool:
    def __init__(self, num: int) -> None:
        self.all = [Block(i) for i in range(num)]
        self.free_block_queue = Queue(self.all)
        self.cached: dict[str, Block] = {}

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        assert kv_cache_group_ids == [0]
        block = self.cached.get(block_hash)
        return None if block is None else [block]


def agent(name: str) -> AgentKey:
    return AgentKey("app", name)


def setup(steps: dict[str, int]) -> tuple[WorkflowTable, DeviceOrder, Pool]:
    table = WorkflowTable()
    order = DeviceOrder(table)
    pool = Pool(10)
    order.bind(pool)
    for i, name in enumerate(steps):  # agent i's prefix: blocks 2i+1, 2i+2 (hashes "<name>0", "<name>1")
        table.observe(agent(name), (name.encode(),), steps, "s")
        order.observe(agent(name), [f"{name}0", f"{name}1"])
        pool.cached[f"{name}0"], pool.cached[f"{name}1"] = pool.all[2 * i + 1], pool.all[2 * i + 2]
    return table, order, pool


def test_prefix_blocks_go_behind_suffixes_the_agent_due_next_last():
    _, order, pool = setup({"a": 0, "b": 2, "c": 1})
    assert order.reorder() == 6
    # 0 and 7..9 hold no prefix (suffixes) and keep vLLM's order at the front; then b (2
    # steps away), c (1), a (next), each chain's tail block before its head.
    assert pool.free_block_queue.ids() == [0, 7, 8, 9, 4, 3, 6, 5, 2, 1]


def test_busy_blocks_stay_put_and_a_gap_ends_a_chain():
    _, order, pool = setup({"a": 0, "b": 1})
    pool.all[1].ref_cnt = 1  # a request holds a's first block: it is not in the free queue
    pool.free_block_queue.remove(pool.all[1])
    del pool.cached["b0"]  # b's first block was evicted: its second can never be a hit
    assert order.reorder() == 1
    assert pool.free_block_queue.ids() == [0, 3, 4, 5, 6, 7, 8, 9, 2]


def test_a_shared_block_takes_the_soonest_agent_and_a_finished_agent_goes_back():
    table, order, pool = setup({"a": 0, "b": 1})
    pool.cached["b0"] = pool.all[1]  # a and b share their first block
    order.reorder()
    assert pool.free_block_queue.ids()[-2:] == [2, 1]  # a (next) last, the shared block with it
    table.finished(agent("a"), "s")  # a just ran: b is due now
    order.reorder()
    assert pool.free_block_queue.ids()[-3:] == [2, 4, 1]


def test_forgotten_apps_and_an_unbound_pool_move_nothing():
    table = WorkflowTable(idle_s=10.0, clock=lambda: now[0])
    now = [0.0]
    order = DeviceOrder(table)
    assert order.reorder() == 0  # no pool bound yet
    pool = Pool(4)
    order.bind(pool)
    table.observe(agent("a"), (b"a",), {"a": 0}, "s")
    order.observe(agent("a"), ["a0"])
    pool.cached["a0"] = pool.all[1]
    assert order.reorder() == 1
    now[0] = 100.0  # the app went silent for longer than idle_s
    assert order.reorder() == 0


def test_among_agents_equally_far_the_one_seen_longest_ago_goes_first():
    table, order, pool = setup({"a": 3, "b": 3})
    order.reorder()
    assert pool.free_block_queue.ids()[-4:] == [2, 1, 4, 3]  # a was seen first
    order.observe(agent("a"), ["a0", "a1"])  # a sends again
    order.reorder()
    assert pool.free_block_queue.ids()[-4:] == [4, 3, 2, 1]
