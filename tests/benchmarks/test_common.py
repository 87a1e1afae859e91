"""benchmarks.common: waiting for a quiet machine between stacks' turns."""

from __future__ import annotations

from collections.abc import Iterator

from benchmarks.common import cpu_ticks, wait_quiet


def ticks_of(windows: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """Cumulative (total, idle) ticks, one reading per window of (total, idle) ticks."""
    total = idle = 0
    yield total, idle
    for window_total, window_idle in windows:
        total, idle = total + window_total, idle + window_idle
        yield total, idle


def test_it_waits_through_busy_windows_and_stops_at_the_first_quiet_one():
    readings = ticks_of([(100, 0), (100, 50), (100, 95), (100, 0)])
    calls = []

    def ticks() -> tuple[int, int]:
        calls.append(1)
        return next(readings)

    wait_quiet(max_s=5.0, window_s=0.0, busy_share=0.1, ticks=ticks)
    assert len(calls) == 4  # the first reading, then two busy windows, then the quiet one


def test_a_machine_that_never_goes_quiet_is_waited_on_for_max_s_only():
    busy = ticks_of([(100, 0)] * 10_000)
    waited = wait_quiet(max_s=0.05, window_s=0.001, ticks=lambda: next(busy))
    assert 0.05 <= waited < 1.0


def test_the_machine_s_ticks_count_idle_within_all():
    total, idle = cpu_ticks()
    assert 0 <= idle <= total and total > 0
