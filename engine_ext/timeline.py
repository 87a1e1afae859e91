"""Timeline: when one request passed each stage on its way to its first token, and on.

The engine thread stamps it (monotonic seconds); spans are built from it once the
request is done, so tracing never runs inside the engine loop. The stages are
contiguous up to the first token, so their durations add up to the engine's TTFT:

    queue   arrived   -> admitted   waiting for room (KV blocks, a batch slot, a loading prefix)
    plan    admitted  -> planned    prefix match and reuse decisions (segment lookups, anchors)
    prefill planned   -> prefilled  KV assembly per reuse method (its own intervals inside),
                                    the forward passes, and the steps of other requests between chunks
    first   prefilled -> first_token sampling and emitting the first token
    decode  first_token -> finished

A preempted request keeps its first admission: recomputing after a preemption is
part of its prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple


class Interval(NamedTuple):
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    planned: float | None = None
    prefilled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    assembly: dict[str, list[Interval]] = field(default_factory=dict)  # reuse method -> when it placed KV
    num_prefill_steps: int = 0

    def admit(self, started: float) -> None:
        """Admission began at `started` and its reuse decisions are made now (first time only)."""
        if self.admitted is None:
            self.admitted, self.planned = started, time.monotonic()

    def placed(self, method: str, interval: Interval) -> None:
        self.assembly.setdefault(method, []).append(interval)

    def stages(self) -> dict[str, Interval]:
        """The stages reached so far, in order (see the module docstring)."""
        marks = [("queue", self.arrived, self.admitted), ("plan", self.admitted, self.planned),
                 ("prefill", self.planned, self.prefilled), ("first", self.prefilled, self.first_token),
                 ("decode", self.first_token, self.finished)]
        return {name: Interval(start, end) for name, start, end in marks if start is not None and end is not None}

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived
