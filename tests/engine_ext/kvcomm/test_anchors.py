"""AnchorPool: eligibility and the pruning order."""

from __future__ import annotations

from engine_ext.kv.blobs import Blob
from engine_ext.kvcomm.anchors import AgentOffsets, Anchor, AnchorPool

_BLOB = Blob(1, [], [])


def anchor(anchor_id: int, num_tokens: int = 10, agents=("a",), activations: int = 0) -> Anchor:
    out = Anchor(anchor_id, tuple(range(anchor_id, anchor_id + num_tokens)), _BLOB,
                 {agent: AgentOffsets(_BLOB) for agent in agents})
    out.num_activations = activations
    return out


def test_eligible_anchors_are_long_enough_and_measured_for_the_agent():
    pool = AnchorPool(max_anchors=5, prune_window=2)
    short, long_, other_agent = anchor(0, 5), anchor(1, 20), anchor(2, 20, agents=("b",))
    for a in (short, long_, other_agent):
        pool.add(a)
    assert pool.eligible("a", 10) == [long_]
    assert pool.eligible("a", 5) == [short, long_]
    assert pool.eligible("b", 10) == [other_agent]
    assert pool.eligible("c", 1) == []


def test_full_pool_drops_the_least_activated_of_the_oldest_window():
    pool = AnchorPool(max_anchors=3, prune_window=2)
    a0, a1, a2 = anchor(0, activations=5), anchor(1, activations=1), anchor(2, activations=0)
    for a in (a0, a1, a2):
        assert pool.add(a) == []
    # a2 is the least activated overall, but it is not among the 2 oldest: a1 goes.
    assert pool.add(anchor(3)) == [a1]
    assert [a.anchor_id for a in pool.anchors] == [0, 2, 3]
    # Now the window is (a0, a2): a2 goes.
    assert pool.add(anchor(4)) == [a2]
    assert len(pool) == 3


def test_ties_drop_the_oldest():
    pool = AnchorPool(max_anchors=2, prune_window=2)
    a0, a1 = anchor(0), anchor(1)
    pool.add(a0)
    pool.add(a1)
    assert pool.add(anchor(2)) == [a0]


def test_find_matches_exact_tokens_only():
    pool = AnchorPool(max_anchors=4, prune_window=2)
    a = anchor(0, 8)
    pool.add(a)
    assert pool.find(a.token_ids) is a
    assert pool.find(a.token_ids[:-1]) is None
