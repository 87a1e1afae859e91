"""Timeline: when one request passed each stage on its way to its first token, and on.

The server creates it when the request arrives and the engine thread stamps it
(monotonic seconds); spans are built from it once the request is done, so tracing
never runs inside the engine loop. The stages are contiguous up to the first token,
so their durations add up to the engine's TTFT:

    prepare arrived   -> queued     tokenizing the prompt, aligning the plan's segments to tokens
    queue   queued    -> admitted   waiting for the engine thread and for room (KV blocks, a
                                    batch slot, a loading prefix, a round's siblings)
    plan    admitted  -> planned    prefix match and reuse decisions (segment lookups, anchors)
    prefill planned   -> prefilled  KV assembly per reuse method (placements, restores,
                                    tier fetches), the forward steps that computed its
                                    chunks, and the wait between them (other requests' steps)
    first   prefilled -> first_token the first decode step's sampling (logits of the last
                                    prompt token) and handing the token over
    decode  first_token -> finished

A preempted request keeps its first admission: recomputing after a preemption is
part of its prefill. A request used without a server (queued never stamped) starts
with its queue stage.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
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


STAGES = ("prepare", "queue", "plan", "prefill", "first", "decode")
TTFT_STAGES = STAGES[:5]  # contiguous, up to the first token


@dataclass
class Timeline:
    arrived: float = field(default_factory=time.monotonic)
    queued: float | None = None
    admitted: float | None = None
    planned: float | None = None
    prefilled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    assembly: dict[str, list[Placement]] = field(default_factory=dict)  # reuse method -> its placements
    prefill_steps: list[Interval] = field(default_factory=list)  # the engine steps that computed its chunks

    def enqueue(self) -> None:
        """The prompt is ready and handed to the engine (first time only)."""
        if self.queued is None:
            self.queued = time.monotonic()

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

    def assembly_s(self) -> float:
        """Seconds of every KV placement, all methods."""
        return sum(p.seconds for placements in self.assembly.values() for p in placements)

    def prefill_wait_s(self, prefill: Interval) -> float:
        """The part of the prefill stage spent neither placing KV nor computing its chunks."""
        return max(prefill.seconds - self.prefill_compute_s() - self.assembly_s(), 0.0)

    def stages(self, until: float | None = None) -> dict[str, Interval]:
        """The stages passed so far, in order (see the module docstring). With `until`
        (a failed or abandoned request), the stage it was in ends there."""
        marks = [self.arrived, self.queued, self.admitted, self.planned, self.prefilled, self.first_token,
                 self.finished]
        names = list(STAGES)
        if self.queued is None:  # no server: the queue starts at arrival
            del marks[1], names[0]
        out = {}
        for name, start, end in zip(names, marks, marks[1:]):
            if start is None:
                break
            if end is None:
                if until is not None and until >= start:
                    out[name] = Interval(start, until)
                break
            out[name] = Interval(start, end)
        return out

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived

    def snapshot(self) -> Timeline:
        """A copy safe to read while the engine thread may still stamp this one (an
        abandoned request): each container is copied in one step under the GIL."""
        assembly = list(self.assembly.items())
        return replace(self, assembly={method: list(placements) for method, placements in assembly},
                       prefill_steps=list(self.prefill_steps))


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
    out: dict[str, object] = {f"{name}_s": stages[name].seconds for name in TTFT_STAGES if name in stages}
    out["ttft_s"] = line.ttft
    assembly = {method: sum(p.seconds for p in placements) for method, placements in line.assembly.items()}
    out["assembly_s"] = assembly
    out["prefill_steps"] = line.num_prefill_steps
    out["prefill_tokens_per_s"] = tokens_per_s
    if "prefill" not in stages or line.ttft is None:
        return out
    compute = line.prefill_compute_s()
    out["prefill_compute_s"] = compute
    out["prefill_wait_s"] = line.prefill_wait_s(stages["prefill"])
    if tokens_per_s:
        dense = line.ttft - compute - line.assembly_s() + num_prompt_tokens / tokens_per_s
        out["dense_ttft_s"] = dense
        out["saved_s"] = dense - line.ttft
    return out
