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


TTFT_KEY = "kvrelay_ttft"  # the key of the breakdown under the response's kv_transfer_params


class PrefillRate:
    """The engine's own prefill speed, tokens per second: an exponential average over the
    steps that computed prompt tokens. It prices the tokens reuse did not compute, so
    a TTFT breakdown can say what a dense prefill would have cost."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.tokens_per_s: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        sample = num_tokens / seconds
        current = self.tokens_per_s
        self.tokens_per_s = sample if current is None else current + self.smoothing * (sample - current)


def breakdown(line: Timeline, num_prompt_tokens: int, tokens_per_s: float | None) -> dict[str, object]:
    """The TTFT breakdown reported to the caller (the gateway keeps it per request):
    each stage's seconds, KV assembly per method, and the dense TTFT the engine's own
    prefill rate predicts for the whole prompt, so what reuse saved is dense - actual."""
    stages = line.stages()
    out: dict[str, object] = {f"{name}_s": stages[name].seconds for name in ("queue", "plan", "prefill", "first")
                              if name in stages}
    out["ttft_s"] = line.ttft
    out["assembly_s"] = {method: sum(i.seconds for i in intervals) for method, intervals in line.assembly.items()}
    out["prefill_steps"] = line.num_prefill_steps
    out["prefill_tokens_per_s"] = tokens_per_s
    if tokens_per_s and line.ttft is not None and "prefill" in stages:
        dense = line.ttft - stages["prefill"].seconds + num_prompt_tokens / tokens_per_s
        out["dense_ttft_s"] = dense
        out["saved_s"] = dense - line.ttft
    return out
