"""TierIndex: new blocks go to host, a full host demotes to disk, a full disk deletes;
victims follow the workflow policy; promotion only into room the caller may take."""

from __future__ import annotations

from engine_ext.kv.eviction import LruPolicy
from engine_ext.tiers.policy import WorkflowPolicy
from engine_ext.tiers.workflow import AgentKey, WorkflowTable
from engine_ext.vllm.index import BlockMove, BlockSave, TierIndex


def h(i: int) -> bytes:
    return bytes([i]) * 16


def test_blocks_fill_host_then_demote_to_disk_then_leave():
    index = TierIndex(2, 2, LruPolicy())
    assert index.add(h(1), 10) == [BlockSave(h(1), "host", 10)]
    assert index.add(h(1), 11) == []  # already kept
    index.add(h(2), 11)
    assert index.add(h(3), 12) == [BlockMove(h(1), "host", "disk"), BlockSave(h(3), "host", 12)]
    index.add(h(4), 13)  # h2 -> disk
    assert index.add(h(5), 14) == [BlockMove(h(1), "disk", None), BlockMove(h(3), "host", "disk"),
                                   BlockSave(h(5), "host", 14)]
    assert [index.where(h(i)) for i in range(1, 6)] == [None, "disk", "disk", "host", "host"]
    assert (index.num_demotions, index.num_deletions) == (3, 1)


def test_touch_keeps_a_read_block_and_host_off_saves_to_disk():
    index = TierIndex(2, 0, LruPolicy())
    index.add(h(1), 0)
    index.add(h(2), 1)
    index.touch(h(1))
    assert index.add(h(3), 2) == [BlockMove(h(2), "host", None), BlockSave(h(3), "host", 2)]
    disk_only = TierIndex(0, 4, LruPolicy())
    assert disk_only.add(h(1), 0) == [BlockSave(h(1), "disk", 0)]
    assert disk_only.promote(h(1), lambda v: True) == []


def test_workflow_priorities_pick_the_victim():
    table = WorkflowTable()
    table.observe(AgentKey("app", "soon"), (h(1),), {"soon": 1, "later": 5})
    table.observe(AgentKey("app", "later"), (h(2),), None)
    index = TierIndex(2, 3, WorkflowPolicy(table))
    index.add(h(1), 1)
    index.add(h(2), 2)
    # The agent 5 steps away gives way before the next agent, though its block is newer...
    assert index.add(h(3), 3)[0] == BlockMove(h(2), "host", "disk")
    # ...and a block in no prefix goes before either.
    assert index.add(h(4), 4)[0] == BlockMove(h(3), "host", "disk")
    assert index.where(h(1)) == "host"


def test_promotion_takes_only_room_the_caller_may_take():
    index = TierIndex(1, 4, LruPolicy())
    index.add(h(1), 0)
    index.add(h(2), 1)  # h1 -> disk
    assert index.promote(h(1), lambda victim: False) == []
    assert index.where(h(1)) == "disk"
    assert index.promote(h(1), lambda victim: True) == [BlockMove(h(2), "host", "disk"),
                                                         BlockMove(h(1), "disk", "host")]
    assert (index.where(h(1)), index.where(h(2))) == ("host", "disk")


def test_drop_and_adopt():
    index = TierIndex(2, 2, LruPolicy())
    index.adopt(h(1), "disk")
    index.adopt(h(1), "host")  # tiers are exclusive: the first place found stays
    assert index.where(h(1)) == "disk"
    index.drop(h(1))
    assert index.where(h(1)) is None and index.num_blocks("disk") == 0
