"""Deadline: the time one request's planning may take.

Planning runs on the gateway's event loop, so every millisecond it takes delays every
other request. Each stage of planning is bounded by construction (linear in the prompt,
bounded in the app's state); the deadline is the backstop: stages check it between
pieces of work, and once it has passed the rest of the plan is skipped, the request
going on with what was planned so far.

The clock is the thread's CPU time, not the wall clock: the budget bounds the work a
plan does. On a busy machine another process may preempt the loop mid-plan; counting
that would cut plans (and their reuse) at random, when the loop itself did no more work.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class OutOfTime(Exception):
    """Raised by work that cannot stop halfway with a usable result."""


class Deadline:
    def __init__(self, budget_s: float, clock: Callable[[], float] = time.thread_time) -> None:
        self._clock = clock
        self.at = clock() + budget_s

    def expired(self) -> bool:
        return self._clock() >= self.at

    def check(self) -> None:
        if self.expired():
            raise OutOfTime


NO_DEADLINE = Deadline(float("inf"))  # for callers outside the request path (the admin views)
