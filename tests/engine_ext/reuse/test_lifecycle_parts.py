"""The lock-handle interface (engine_ext/reuse/locks.py) and the method registry
(engine_ext/reuse/methods.py), without a model."""

from __future__ import annotations

from engine_ext.config import ReuseConfig
from engine_ext.reuse.locks import CacheLock, Pins
from engine_ext.reuse.methods import METHODS, PLACED_METHODS
from engine_ext.reuse.segments import REUSE_METHODS, TokenSegment


class CountingLock(CacheLock):
    def __init__(self, log: list[str], name: str) -> None:
        super().__init__()
        self.log, self.name = log, name

    def _unpin(self) -> None:
        self.log.append(self.name)


def test_a_lock_releases_once() -> None:
    log: list[str] = []
    lock = CountingLock(log, "a")
    lock.release()
    lock.release()
    assert log == ["a"] and not lock.held


def test_pins_release_everything_in_order_once_and_take_new_pins() -> None:
    log: list[str] = []
    pins = Pins()
    a, b = CountingLock(log, "a"), CountingLock(log, "b")
    pins.add(a, b)
    b.release()  # let go elsewhere first (a restore applied at admission)
    assert len(pins) == 1
    pins.release()
    pins.release()
    assert log == ["b", "a"] and len(pins) == 0
    pins.add(CountingLock(log, "c"))  # a preempted request admitted again
    pins.release()
    assert log == ["b", "a", "c"]


def test_every_plan_method_is_registered() -> None:
    assert set(METHODS) == set(REUSE_METHODS)
    assert PLACED_METHODS == {"shift", "blend", "link", "kvcomm"}


def test_method_costs() -> None:
    config = ReuseConfig()
    seg = TokenSegment(10, 110, "shared_block")
    assert METHODS["blend"].num_recomputed(seg, config) > 0 and METHODS["blend"].blends
    assert METHODS["link"].num_linked(seg, config) == min(config.link_tokens, 100)
    assert METHODS["link"].num_linked(seg._replace(start=0, end=100), config) == 0
    assert METHODS["shift"].num_recomputed(seg, config) == 0
    assert METHODS["kvcomm"].uses_anchors and not METHODS["prefix"].places and not METHODS["dense"].places
