"""Deadline: the time one request's planning may take.

Planning runs on the gateway's event loop, so every millisecond it takes delays every
other request. Each stage of planning is bounded by construction (linear in the prompt,
bounded in the app's state); the deadline is the backstop: stages check it between
pieces of work, and once it has passed the rest of the plan is skipped, the request
going on with what was planned so far.

The clock is the thread's CPU time, not the wall clock: the budget bounds the work a
plan does. On a busy machine another process may preempt the loop mid-plan; counting
that would cut plans (and their reuse) at random, when the loop itself did no more work.
For the same reason the garbage collector's pauses are not counted either: a full
collection walks every object of the process (in a gateway holding much inferred state,
tens of milliseconds), on whichever thread happened to allocate, and it cut the plan of
whatever request was planning then.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any


class _CollectorPauses:
    """The CPU time the garbage collector has taken on each thread, from gc.callbacks
    (which run on the collecting thread, under the GIL)."""

    def __init__(self) -> None:
        self._local = threading.local()
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._local.started = time.thread_time()
        elif (started := getattr(self._local, "started", None)) is not None:
            self._local.paused = self.paused() + time.thread_time() - started
            self._local.started = None

    def paused(self) -> float:
        return float(getattr(self._local, "paused", 0.0))


_pauses: _CollectorPauses | None = None
_pauses_lock = threading.Lock()


def planning_time() -> float:
    """This thread's CPU time less the collector's pauses on it, in seconds. The first
    call installs the one collector callback of the process."""
    global _pauses
    if _pauses is None:
        with _pauses_lock:
            if _pauses is None:
                _pauses = _CollectorPauses()
    return time.thread_time() - _pauses.paused()


_THREAD_CLOCKS = (planning_time, time.thread_time)  # one thread's CPU time: never ahead of the wall clock


class OutOfTime(Exception):
    """Raised by work that cannot stop halfway with a usable result."""


class Deadline:
    """Spent once `clock` has advanced `budget_s` from now.

    A thread's CPU time advances no faster than the wall clock, so with a CPU clock the
    deadline cannot have passed before the wall clock has run the whole budget: until
    then expired() reads only the wall clock (vDSO, a tenth of a microsecond), not the
    CPU clock (a system call, half a microsecond or more, asked several times a plan)."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = planning_time) -> None:
        self._clock = clock
        self.at = clock() + budget_s
        self._not_before = time.perf_counter() + budget_s if clock in _THREAD_CLOCKS else float("-inf")

    def expired(self) -> bool:
        return time.perf_counter() >= self._not_before and self._clock() >= self.at

    def check(self) -> None:
        if self.expired():
            raise OutOfTime


NO_DEADLINE = Deadline(float("inf"), time.thread_time)  # for callers outside the request path (the admin views)
