"""Timeline: when one request passed each stage on its way to its first token, and on.

The engine thread stamps it (monotonic seconds); spans are built from it once the
request is done, so tracing never runs inside the engine loop. The stages are
contiguous up to the first token, so their durations add up to the engine's TTFT:

    queue   arrived   -> admitted   waiting for room (KV blocks, a batch slot, a loading prefix)
    plan    admitted  -> planned    prefix match and reuse decisions (segment lookups, anchors)
    prefill planned   -> prefilled  KV assembly per reuse method (placements, restores,
                                    tier fetches), the forward steps that computed its
                                    chunks, and the wait between them (other requests' steps)
    first   prefilled -> first_token sampling and emitting the first token
    decode  first_token -> finished

A preempted request keeps its first admission: recomputing after a preemption is
part of its prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import NamedTuple


class Interval(NamedTuple):
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def holds(self, other: Interval | Placement) -> bool:
        return self.start <= other.start and other.end <= self.end


class Placement(NamedTuple):
    """One KV assembly: when a reuse method put `num_tokens` of cached KV in place."""
    start: float
    end: float
    num_tokens: int

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
    assembly: dict[str, list[Placement]] = field(default_factory=dict)  # reuse method -> its placements
    prefill_steps: list[Interval] = field(default_factory=list)  # the engine steps that computed its chunks

    def admit(self, started: float, planned: float) -> None:
        """Admission began at `started`; its reuse decisions were made at `planned`
        (first admission only: a preempted request keeps its first)."""
        if self.admitted is None:
            self.admitted, self.planned = started, planned

    def placed(self, method: str, placement: Placement) -> None:
        self.assembly.setdefault(method, []).append(placement)

    @property
    def num_prefill_steps(self) -> int:
        return len(self.prefill_steps)

    def prefill_compute_s(self) -> float:
        """Seconds of the steps that computed the prompt, less the KV placements inside them."""
        inside = sum(p.seconds for placements in self.assembly.values() for p in placements
                     if any(step.holds(p) for step in self.prefill_steps))
        return sum(step.seconds for step in self.prefill_steps) - inside

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
# A caller sends this header (any value but 0/false/off) to get the breakdown back even
# without kv_transfer_params: the gateway always does, reuse on or off.
TTFT_HEADER = "x-kvrelay-ttft"


def wants_breakdown(headers: Mapping[str, str]) -> bool:
    value = headers.get(TTFT_HEADER)
    return value is not None and value.strip().lower() not in ("0", "false", "off")


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
    each stage's seconds, the prefill split into KV assembly per method, compute and
    wait, and the dense TTFT the engine's own prefill rate predicts for the whole
    prompt, so what reuse saved is dense - actual. The dense estimate keeps the queue,
    plan, wait and first-token parts as measured and prices the prompt's compute."""
    stages = line.stages()
    out: dict[str, object] = {f"{name}_s": stages[name].seconds for name in ("queue", "plan", "prefill", "first")
                              if name in stages}
    out["ttft_s"] = line.ttft
    assembly = {method: sum(p.seconds for p in placements) for method, placements in line.assembly.items()}
    out["assembly_s"] = assembly
    out["prefill_steps"] = line.num_prefill_steps
    out["prefill_tokens_per_s"] = tokens_per_s
    if "prefill" not in stages or line.ttft is None:
        return out
    compute = line.prefill_compute_s()
    out["prefill_compute_s"] = compute
    out["prefill_wait_s"] = max(stages["prefill"].seconds - compute - sum(assembly.values()), 0.0)
    if tokens_per_s:
        dense = line.ttft - compute - sum(assembly.values()) + num_prompt_tokens / tokens_per_s
        out["dense_ttft_s"] = dense
        out["saved_s"] = dense - line.ttft
    return out
