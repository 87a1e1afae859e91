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
    assert index.add(h(1), 10, "r") == [BlockSave(h(1), "host", 10, "r")]
    assert index.add(h(1), 11, "r") == []  # already kept
    index.add(h(2), 11, "r")
    assert index.add(h(3), 12, "r") == [BlockMove(h(1), "host", "disk"), BlockSave(h(3), "host", 12, "r")]
    index.add(h(4), 13, "r")  # h2 -> disk
    assert index.add(h(5), 14, "r") == [BlockMove(h(1), "disk", None), BlockMove(h(3), "host", "disk"),
                                   BlockSave(h(5), "host", 14, "r")]
    assert [index.where(h(i)) for i in range(1, 6)] == [None, "disk", "disk", "host", "host"]
    assert (index.num_demotions, index.num_deletions) == (3, 1)


def test_touch_keeps_a_read_block_and_host_off_saves_to_disk():
    index = TierIndex(2, 0, LruPolicy())
    index.add(h(1), 0, "r")
    index.add(h(2), 1, "r")
    index.touch(h(1))
    assert index.add(h(3), 2, "r") == [BlockMove(h(2), "host", None), BlockSave(h(3), "host", 2, "r")]
    disk_only = TierIndex(0, 4, LruPolicy())
    assert disk_only.add(h(1), 0, "r") == [BlockSave(h(1), "disk", 0, "r")]
    assert disk_only.promote(h(1), lambda v: True) == []


def test_workflow_priorities_pick_the_victim():
    table = WorkflowTable()
    table.observe(AgentKey("app", "soon"), (h(1),), {"soon": 1, "later": 5})
    table.observe(AgentKey("app", "later"), (h(2),), None)
    index = TierIndex(2, 3, WorkflowPolicy(table))
    index.add(h(1), 1, "r")
    index.add(h(2), 2, "r")
    # The agent 5 steps away gives way before the next agent, though its block is newer...
    assert index.add(h(3), 3, "r")[0] == BlockMove(h(2), "host", "disk")
    # ...and a block in no prefix goes before either.
    assert index.add(h(4), 4, "r")[0] == BlockMove(h(3), "host", "disk")
    assert index.where(h(1)) == "host"


def test_promotion_takes_only_room_the_caller_may_take():
    index = TierIndex(1, 4, LruPolicy())
    index.add(h(1), 0, "r")
    index.add(h(2), 1, "r")  # h1 -> disk
    assert index.promote(h(1), lambda victim: False) == []
    assert index.where(h(1)) == "disk"
    assert index.promote(h(1), lambda victim: True) == [BlockMove(h(2), "host", "disk"),
                                                         BlockMove(h(1), "disk", "host")]
    assert (index.where(h(1)), index.where(h(2))) == ("host", "disk")


def test_drop_and_adopt():
    index = TierIndex(2, 2, LruPolicy())
    assert index.adopt(h(1), "disk")
    assert not index.adopt(h(1), "host")  # tiers are exclusive: the first place found stays
    assert index.where(h(1)) == "disk"
    assert index.drop(h(1)) == [BlockMove(h(1), "disk", None)]
    assert index.where(h(1)) is None and index.num_blocks("disk") == 0
    assert index.drop(h(1)) == []


def test_promoting_into_a_full_host_with_a_full_disk_never_picks_the_block_itself():
    index = TierIndex(1, 1, LruPolicy())
    index.add(h(1), 0, "r")
    index.add(h(2), 1, "r")  # h1 -> disk; both tiers full
    assert index.promote(h(1), lambda victim: True) == [BlockMove(h(2), "host", "disk"),
                                                         BlockMove(h(1), "disk", "host")]
    assert (index.where(h(1)), index.where(h(2))) == ("host", "disk")
    assert index.promote(h(2), lambda victim: False) == [] and index.where(h(2)) == "disk"


def test_a_prefix_loses_its_tail_first():
    index = TierIndex(3, 0, LruPolicy())
    chain = [h(1), h(2), h(3)]
    for i, block in enumerate(chain):
        index.add(block, i, "r")
    index.touch_chain(chain)
    assert index.add(h(4), 3, "r")[0] == BlockMove(h(3), "host", None)
