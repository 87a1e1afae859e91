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

What reuse saved is priced against prefix caching alone, the engine's own exact path:
at a prompt's first step the engine notes the longest prefix that path would have
served at that moment (PrefixShadow) and what computing the rest densely would cost
(PrefillRate, measured on the engine's dense prefills). Only reuse beyond it (placed
segments, restored round caches, collective prefills) counts as saved.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kvrelay.wire.reports import TtftBreakdown


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
EXACT_LOADS = frozenset({"tier_fetch"})  # placements of exact prefix blocks: part of the prefix path


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
    # The baseline, noted at its first step (see `baseline`): None until then.
    num_prefix_hit: int | None = None  # prompt tokens prefix caching alone would have served
    num_exact_hit: int | None = None  # of the prompt, what this request got exactly (prefix cache, tier loads)
    prefix_path_s: float | None = None  # computing the rest densely, priced; None: no similar prefill measured
    # Seconds after its forward pass keeping its segments for later reuse (segment index,
    # anchors, round caches): inside its first stage, and work prefix caching alone skips.
    keep_s: float = 0.0

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

    def baseline(self, num_prefix_hit: int, num_exact_hit: int, prefix_path_s: float | None) -> None:
        """What prefix caching alone would have done for this prompt when it was admitted:
        served `num_prefix_hit` tokens and computed the rest in `prefix_path_s` (None:
        unknown). This request itself got `num_exact_hit` tokens exactly. First call only:
        the cache as it was at admission, not after a preemption."""
        if self.num_prefix_hit is None:
            self.num_prefix_hit, self.num_exact_hit, self.prefix_path_s = num_prefix_hit, num_exact_hit, prefix_path_s

    def reused_tokens(self) -> int:
        """Tokens reuse put in place beyond the prefix path: every placement but tier loads
        (exact prefix blocks coming back, which prefix caching alone would load too)."""
        return sum(p.num_tokens for method, placements in self.assembly.items() if method not in EXACT_LOADS
                   for p in placements)

    def reuse_assembly_s(self) -> float:
        """Seconds of the placements `reused_tokens` counts."""
        return sum(p.seconds for method, placements in self.assembly.items() if method not in EXACT_LOADS
                   for p in placements)

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


class PrefillRate:
    """How long the engine takes to prefill densely, learnt from its own steps, so a TTFT
    breakdown can price what prefix caching alone would have computed.

    A step computing n tokens after `cached` ones takes a + b*n + c*n*ctx seconds,
    ctx = cached + n/2 the mean context a computed token attends to (a: the step's fixed
    cost; b: per token; c: attention, which makes a token dearer the longer its context).
    Fit by least squares with the coefficients kept >= 0, older steps weighing `forget`
    times less per new step (the machine's load drifts). Only steps that ran dense
    prefill chunks alone and computed at least MIN_TOKENS teach it: a few-token step is
    all fixed cost and would price a long prompt at its per-token rate.

    It prices a prompt only like prefills it has measured: once it has seen steps of
    MIN_LENGTHS different lengths (powers of two apart, so the three terms are told apart),
    and one within a power of two of the tokens to price; otherwise None, unknown, rather
    than a guess.
    """

    MIN_TOKENS = 32
    MIN_LENGTHS = 3

    def __init__(self, max_chunk_tokens: int = 2048, forget: float = 0.98) -> None:
        self.max_chunk_tokens = max_chunk_tokens  # the engine computes a longer prompt in chunks of this many
        self.forget = forget
        self.num_samples = 0
        self._xx = [[0.0] * 3 for _ in range(3)]  # weighted sums of x x^T, x = (1, n, n*ctx/1000)
        self._xy = [0.0] * 3  # ... of x * seconds
        self._yy = 0.0  # ... of seconds^2 (a fit's residual)
        self._lengths: set[int] = set()  # log2 of the tokens of each step measured
        self._coef: tuple[float, float, float] | None = None  # the fit, until the next sample

    def observe(self, chunks: Iterable[tuple[int, int]], seconds: float) -> None:
        """One step that computed dense prefill chunks alone, each given as (tokens it
        computed, tokens cached before them), in `seconds`."""
        chunks = [(n, cached) for n, cached in chunks if n > 0]
        num_tokens = sum(n for n, _ in chunks)
        if num_tokens < self.MIN_TOKENS or not seconds > 0:
            return
        x = (1.0, float(num_tokens), sum(n * (cached + n / 2) for n, cached in chunks) / 1e3)
        for i in range(3):
            self._xy[i] = self.forget * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self.forget * self._xx[i][j] + x[i] * x[j]
        self._yy = self.forget * self._yy + seconds * seconds
        self._lengths.add(_log2(num_tokens))
        self.num_samples += 1
        self._coef = None

    def knows(self, num_tokens: int) -> bool:
        """Whether a prefill of `num_tokens` is like ones it measured (see the class)."""
        length = _log2(min(num_tokens, self.max_chunk_tokens))
        return len(self._lengths) >= self.MIN_LENGTHS and any(abs(length - seen) <= 1 for seen in self._lengths)

    def seconds(self, num_tokens: int, num_cached: int = 0) -> float | None:
        """Computing `num_tokens` densely after `num_cached` cached ones, in chunks as the
        engine would; 0 for nothing to compute, None when unknown."""
        if num_tokens <= 0:
            return 0.0
        if not self.knows(num_tokens):
            return None
        if self._coef is None:
            self._coef = self._fit()
        a, b, c = self._coef
        total, done = 0.0, 0
        while done < num_tokens:
            n = min(self.max_chunk_tokens, num_tokens - done)
            total += a + b * n + c * n * (num_cached + done + n / 2) / 1e3
            done += n
        return total

    def _fit(self) -> tuple[float, float, float]:
        """Least squares with every coefficient >= 0: of the fits over each subset of the
        terms (the others held at 0), the best with no negative coefficient. A negative
        step cost or attention cost is noise, and would price short prompts below zero."""
        best, best_sse = (0.0, 0.0, 0.0), math.inf
        for terms in _TERM_SUBSETS:
            solved = _solve([[self._xx[i][j] for j in terms] for i in terms], [self._xy[i] for i in terms])
            if solved is None or min(solved) < 0:
                continue
            coef = [0.0, 0.0, 0.0]
            for i, value in zip(terms, solved):
                coef[i] = value
            sse = self._yy - 2 * sum(coef[i] * self._xy[i] for i in range(3)) + \
                sum(coef[i] * self._xx[i][j] * coef[j] for i in range(3) for j in range(3))
            if sse < best_sse:
                best, best_sse = (coef[0], coef[1], coef[2]), sse
        return best


_TERM_SUBSETS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,))


def _log2(n: int) -> int:
    return max(n, 1).bit_length() - 1


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (a small square system), by Gaussian elimination with partial
    pivoting; None when a is singular (terms the samples cannot tell apart)."""
    n = len(b)
    rows = [list(row) + [value] for row, value in zip(a, b)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for k in range(col, n + 1):
                rows[r][k] -= factor * rows[col][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (rows[r][n] - sum(rows[r][k] * x[k] for k in range(r + 1, n))) / rows[r][r]
    return x


class PrefixShadow:
    """The prefix cache that prefix caching alone would hold: the chained hashes of every
    full block any request computed and could share, exact or not, the least recently
    used leaving first past `capacity` blocks (the engine's KV pool).

    The real prefix cache holds exact blocks only (engine_ext/kv/manager.py never
    publishes approximate KV), so after approximate reuse its hit falls short of what
    the prefix path would have served, and pricing against it would count prefix hits
    as reuse's savings. The baseline reads this instead (and the real hit, where tiers
    kept a block this has forgotten)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def add(self, hashes: Iterable[bytes]) -> None:
        for block_hash in hashes:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def hit(self, hashes: Sequence[bytes]) -> int:
        """How many of a prompt's leading block hashes it holds (those are used again)."""
        num_hits = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            num_hits += 1
        return num_hits


def breakdown(line: Timeline, num_prompt_tokens: int) -> TtftBreakdown | None:
    """The TTFT breakdown reported to the caller (the gateway keeps it per request),
    None before the first token:
    each stage's seconds, the prefill split into KV assembly per method, compute and
    wait, and the baseline: what prefix caching alone would have served and computed,
    and the TTFT it would have given (`dense_ttft_s`), so `saved_s` = that - actual.

    The baseline keeps queue, plan, wait, tier loads and first token as measured and
    swaps this request's compute, reuse placements and reuse bookkeeping (`keep_s`) for
    the prefix path's priced compute. A request that did exactly the prefix path's work (reuse off, nothing
    placed, no prefix hit lost) saved 0, unpriced; one that reused beyond it is priced
    only when the engine measured similar prefills (no `saved_s` otherwise). Reuse can
    cost: an approximate prefill slower than the dense one, or prefix hits lost to
    approximate KV kept out of the cache, give a negative saving."""
    stages = line.stages()
    out: dict[str, Any] = {f"{name}_s": stages[name].seconds for name in TTFT_STAGES if name in stages}
    if line.ttft is None:
        return None
    out["ttft_s"] = line.ttft
    assembly = {method: sum(p.seconds for p in placements) for method, placements in line.assembly.items()}
    out["assembly_s"] = assembly
    out["prefill_steps"] = line.num_prefill_steps
    if "prefill" not in stages:
        return TtftBreakdown.model_validate(out)
    compute = line.prefill_compute_s()
    out["prefill_compute_s"] = compute
    out["prefill_wait_s"] = line.prefill_wait_s(stages["prefill"])
    if line.num_prefix_hit is None or line.num_exact_hit is None:
        return TtftBreakdown.model_validate(out)  # never reached the engine's first step: no baseline
    reused = line.reused_tokens()
    out["prefix_hit_tokens"] = line.num_prefix_hit
    out["prefix_path_tokens"] = num_prompt_tokens - line.num_prefix_hit
    out["reused_tokens"] = reused
    out["keep_s"] = line.keep_s
    if reused == 0 and line.num_exact_hit >= line.num_prefix_hit:
        out["dense_ttft_s"], out["saved_s"] = line.ttft, 0.0  # the prefix path's own work
    elif line.prefix_path_s is not None:
        out["prefix_path_s"] = line.prefix_path_s
        cost = compute + line.reuse_assembly_s() + line.keep_s
        out["dense_ttft_s"] = line.ttft - cost + line.prefix_path_s
        out["saved_s"] = line.prefix_path_s - cost
    return TtftBreakdown.model_validate(out)
