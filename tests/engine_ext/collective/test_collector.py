"""KVCollector's grouping rules: who waits, who joins."""

from __future__ import annotations

from engine_ext.collective import KVCollector
from engine_ext.config import CollectiveConfig
from kvrelay.wire.plan import RoundInfo
from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.sampling import SamplingParams
from engine_ext.sequence import Sequence


def _seq(round_id: str | None, size: int = 3, arrival: float = 100.0, with_segments: bool = True) -> Sequence:
    info = RoundInfo(id=round_id, size=size, index=0) if round_id else None
    segments = [TokenSegment(0, 3, "private")] if with_segments else []
    return Sequence(request_id=f"r{id(info)}", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(), max_tokens=4,
                    detokenizer=None, scope=ReuseScope("app", "a", info),  # type: ignore[arg-type]  # never decoded
                    arrival_time=arrival, segments=segments)


def test_no_window_never_holds():
    collector = KVCollector(CollectiveConfig())
    first = _seq("r1")
    assert not collector.holds(first, [first], now=100.0)


def test_a_window_holds_the_first_request_until_its_round_is_waiting_or_time_is_up():
    collector = KVCollector(CollectiveConfig(window_ms=50))
    first, second, third = _seq("r1"), _seq("r1"), _seq("r1")
    assert collector.holds(first, [first, second], now=100.01)
    assert not collector.holds(first, [first, second, third], now=100.01)  # the whole round waits
    assert not collector.holds(first, [first, second], now=100.06)  # the window has passed
    assert not collector.holds(_seq(None), [first], now=100.0)  # not a round request
    bare = _seq("r1", with_segments=False)  # e.g. a multi-LoRA adapter's: it can never join a group
    assert not collector.holds(bare, [bare, second], now=100.01)


def test_siblings_are_the_same_rounds_waiting_requests_up_to_max_group():
    collector = KVCollector(CollectiveConfig(max_group=3))
    head = _seq("r1")
    queue = [head, _seq("r2"), _seq("r1"), _seq(None), _seq("r1"), _seq("r1")]
    siblings = collector.siblings(head, queue)
    assert siblings == [queue[2], queue[4]]
    assert collector.siblings(_seq(None), queue) == []


def test_requests_without_placed_segments_form_no_group():
    collector = KVCollector(CollectiveConfig())
    assert collector.form([_seq("r1"), _seq("r1")]) is None  # no assembly: nothing to reuse collectively
    assert collector.num_groups == 0
