"""kvrelay.gateway.idle_watch: a read that waits the whole idle period fails; reads that keep
getting data never do, at one timer per idle period. Driven by a manual clock, so no
test depends on how fast the machine is."""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.gateway.idle_watch import IdleTimeout, IdleWatch


class ManualTimer:
    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """time() and call_at() of an event loop; advance() runs what has come due, in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[ManualTimer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], object]) -> ManualTimer:
        timer = ManualTimer(when, callback)
        self.timers.append(timer)
        return timer

    def pending(self) -> list[ManualTimer]:
        return [t for t in self.timers if not t.cancelled and t.callback is not None]

    def advance(self, to: float) -> None:
        while due := sorted((t for t in self.pending() if t.when <= to), key=lambda t: t.when):
            timer = due[0]
            self.now = timer.when
            callback, timer.callback = timer.callback, None  # runs once
            callback()
        self.now = to


class Stream:
    def __init__(self) -> None:
        self.failed: BaseException | None = None

    def set_exception(self, exc: BaseException) -> None:
        self.failed = exc


def watch(idle_s: float = 1.0) -> tuple[IdleWatch, Stream, ManualClock]:
    clock, stream = ManualClock(), Stream()
    return IdleWatch(stream, idle_s, clock), stream, clock


def test_a_read_that_waits_the_whole_idle_period_fails_the_stream():
    w, stream, clock = watch(1.0)
    w.reading()
    clock.advance(0.99)
    assert stream.failed is None
    clock.advance(1.0)
    assert isinstance(stream.failed, IdleTimeout)


def test_reads_that_keep_getting_data_never_fail_and_use_one_timer_per_period():
    w, stream, clock = watch(1.0)
    for i in range(1000):  # 1000 reads over 100 s, each answered within 0.05 s
        clock.advance(i * 0.1)
        w.reading()
        clock.advance(i * 0.1 + 0.05)
        w.done()
    assert stream.failed is None
    assert len(clock.timers) <= 101  # one per idle period, not one per read
    w.close()
    assert clock.pending() == []


def test_a_read_begun_late_in_the_period_gets_its_whole_idle_time():
    w, stream, clock = watch(1.0)
    w.reading()
    clock.advance(0.1)
    w.done()
    clock.advance(0.9)
    w.reading()  # the timer armed at 0 is due at 1.0, before this read's own deadline
    clock.advance(1.89)
    assert stream.failed is None
    clock.advance(1.9)
    assert isinstance(stream.failed, IdleTimeout)


def test_no_failure_while_no_read_is_pending_and_the_next_read_rearms():
    w, stream, clock = watch(1.0)
    w.reading()
    w.done()
    clock.advance(5.0)  # the consumer is busy (a slow client): not the upstream's stall
    assert stream.failed is None and clock.pending() == []
    w.reading()
    clock.advance(5.99)
    assert stream.failed is None
    clock.advance(6.0)
    assert isinstance(stream.failed, IdleTimeout)


def test_close_cancels_the_timer():
    w, stream, clock = watch(1.0)
    w.reading()
    w.close()
    clock.advance(10.0)
    assert stream.failed is None and clock.pending() == []
