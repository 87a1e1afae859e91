"""`kvrelay bench agents`: captured agent-framework traffic through the product path.

Real frameworks' requests (tests/data/agents) are replayed over HTTP, each run as one
session, against the stacks of benchmarks/agents/stacks.py, one stack at a time (they
share the cores):

1. Per workload, one session at a time: the `prefix` stack first, live (every quoted
   answer replaced by the answer it just got, so prompts are what the app would have
   sent); its prompts are then sent as they are to `kvrelay` (defaults), the
   approximate stacks and vLLM, so every stack reads the same prompts and answers can
   be compared with `prefix`'s (greedy).
2. The mix of all runs at 8 and 32 sessions at once, with a KV budget that holds the
   working set (the C largest runs' longest prompt plus answer) and one half that size:
   `kvrelay`, `prefix` and vLLM, the same prompts again. The quick run (4 sessions at
   once) replays `kvrelay` and `prefix` a second time, in the reverse order, and pools
   each stack's two replays: one replay's p50 is too noisy there to compare.

The gateway's inferred structure is scored from `kvrelay`'s SQL records against the
capture's labels (benchmarks/agents/scoring.py).

This is the short family (the default); `--family long` runs the long-context one
(benchmarks/agents/long.py), which reuses this bench's replays and cells.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.agents import scoring
from benchmarks.agents.replay import Key, Outcome, Replay
from benchmarks.agents.stacks import (APPROXIMATE, MODEL, SHORT_GUARD_RATE, Running, StackName, engine_counters,
                                      fidelity, method_of, started)
from benchmarks.agents.workload import Quote, Run, Workload, load_all
from benchmarks.common import BenchResult
from engine_ext.model_store import resolve_model
from engine_ext.vllm.server import find_vllm_python

QUICK_RUNS = {"kvcomm_team": 2, "village_sep": 2}  # the quick subset: these runs, all in flight at once
QUICK_MAX_TOKENS = 16  # the quick subset's answers are cut shorter
FULL_LEVELS = (8, 32)
FAMILIES = ("short", "long")  # `kvrelay bench agents --family NAME`; short is the default
Prompts = dict[Key, tuple[dict[str, Any], tuple[Quote, ...]]]


@dataclass(frozen=True)
class Cell:
    """One replay's figures."""

    outcomes: dict[Key, Outcome]

    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes.values() if o.ok]

    @property
    def errors(self) -> int:
        return len(self.outcomes) - len(self.ok())

    def ttft_ms(self, q: float) -> float:
        return _quantile([o.ttft_s * 1e3 for o in self.ok()], q)

    def latency_ms(self) -> float:
        return _quantile([o.latency_s * 1e3 for o in self.ok()], 0.5)

    def makespan_s(self, runs: list[Run]) -> float:
        """Mean over sessions of first request sent to last answer in."""
        spans = []
        for run in runs:
            mine = [self.outcomes[r.key] for r in run.requests if r.key in self.outcomes]
            if mine:
                spans.append(max(o.ended_s for o in mine) - min(o.started_s for o in mine))
        return statistics.fmean(spans) if spans else float("nan")

    def throughput_tok_s(self) -> float:
        """Completion tokens per second of wall time over the whole replay."""
        done = self.ok()
        wall = max((o.ended_s for o in done), default=0.0) - min((o.started_s for o in done), default=0.0)
        return sum(o.completion_tokens for o in done) / wall if wall > 0 else float("nan")

    def cached_fraction(self) -> float:
        done = self.ok()
        prompt = sum(o.prompt_tokens for o in done)
        return sum(o.cached_tokens for o in done) / prompt if prompt else 0.0

    def greedy_match(self, reference: Cell, same_prompt: bool = False) -> float:
        """The share of answers identical to the reference's; `same_prompt`: over the
        requests whose prompt was identical too (live replays diverge once an answer does)."""
        pairs = [(o.text, reference.outcomes[k].text) for k, o in self._pairs(reference, same_prompt)]
        return sum(a == b for a, b in pairs) / len(pairs) if pairs else float("nan")

    def num_same_prompt(self, reference: Cell) -> int:
        return len(self._pairs(reference, same_prompt=True))

    def _pairs(self, reference: Cell, same_prompt: bool) -> list[tuple[Key, Outcome]]:
        return [(k, o) for k, o in self.outcomes.items()
                if k in reference.outcomes and (not same_prompt or o.body == reference.outcomes[k].body)]

    def only(self, keys: set[Key]) -> Cell:
        """The figures of these requests alone (one workload, the warm tasks, one agent)."""
        return Cell({k: o for k, o in self.outcomes.items() if k in keys})

    def merged(self, repeat: Cell) -> Cell:
        """This replay and a repeat of the same prompts as one sample; the repeat's keys
        are tagged, so each pairs with its own reference's (see `greedy_match`)."""
        return Cell({**self.outcomes, **{(f"{k[0]}#repeat", k[1]): o for k, o in repeat.outcomes.items()}})

    def ttft_mean_ms(self) -> float:
        done = self.ok()
        return statistics.fmean(o.ttft_s * 1e3 for o in done) if done else float("nan")


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Bench:
    guard_rate = SHORT_GUARD_RATE  # the guard's sample rate on kvrelay_kvcomm and kvrelay_blend

    def __init__(self, quick: bool, model: str | None, log_dir: Path) -> None:
        self.quick = quick
        self.model_dir = resolve_model(model)
        self.log_dir = log_dir
        self.workloads = self._workloads()
        self.has_vllm = find_vllm_python() is not None
        self.metrics: dict[str, float] = {}
        self.rows: list[tuple[str, str, str, str]] = []
        self.notes: list[str] = []
        self.peaks: dict[Key, int] = {}  # each request's prompt plus answer tokens, once measured
        self.engine_counters: dict[str, dict[str, float]] = {}  # stack -> its engine's counters after its last replay
        self._t0 = time.monotonic()

    def _workloads(self) -> list[Workload]:
        return quick_subset(load_all(names=list(QUICK_RUNS))) if self.quick else load_all()

    def _max_tokens(self) -> int | None:
        """A cap on every answer (None: as captured)."""
        return QUICK_MAX_TOKENS if self.quick else None

    def _guard_settle_s(self, runs: list[Run]) -> float:
        """How long the guard's probes may take to finish after a replay."""
        return 120.0

    # -- running ---------------------------------------------------------------------------
    def replay(self, stack: StackName, runs: list[Run], concurrency: int, kv_tokens: int,
               fixed: Prompts | None) -> tuple[Cell, scoring.InferenceScores | None, dict[str, float]]:
        try:
            with started(stack, self.model_dir, kv_tokens, self.log_dir, guard_rate=self.guard_rate) as running:
                replay = Replay(running.url, MODEL, runs, concurrency, fixed, max_tokens=self._max_tokens())
                cell = Cell(replay.run())
                inference = self._inference(running, cell)
                method = method_of(stack)
                guard = fidelity(running.url, method, self._guard_settle_s(runs)) if method is not None else {}
                if running.engine_url is not None:
                    self.engine_counters[stack] = engine_counters(running.engine_url)
        except RuntimeError as exc:  # a stack that would not start: one line for the CLI
            raise ValueError(f"bench agents: {stack}: {exc}") from exc
        self._progress(f"{stack}: {len(cell.outcomes)} requests, {concurrency} at once, {kv_tokens} KV tokens, "
                       f"{cell.errors} errors; TTFT p50 {cell.ttft_ms(0.5):.0f} ms, p95 {cell.ttft_ms(0.95):.0f} ms, "
                       f"{cell.cached_fraction():.3f} of prompt tokens from cache")
        return cell, inference, guard

    def _inference(self, running: Running, cell: Cell) -> scoring.InferenceScores | None:
        if running.db_path is None or running.name == "prefix":
            return None
        time.sleep(1.5)  # the record writer flushes every half second
        records = scoring.read_records(running.db_path)
        return scoring.score(self.workloads, scoring.observed_from(cell.outcomes, records))

    def _progress(self, what: str) -> None:
        print(f"[bench agents +{time.monotonic() - self._t0:.0f}s] {what}", file=sys.stderr, flush=True)

    # -- the bench -------------------------------------------------------------------------
    def run(self) -> BenchResult:
        runs = interleaved(self.workloads)
        if self.quick:
            self._concurrent(runs, [len(runs)], ["full"], prompts=None)
        else:
            prompts = self._per_workload(runs)
            self._concurrent(runs, list(FULL_LEVELS), ["full", "half"], prompts)
        if not self.has_vllm:
            self.notes.append("vLLM skipped: no vLLM venv (make vllm-venv)")
            self._progress(self.notes[-1])
        return BenchResult("agents", self.metrics, self._config(), self.rows,
                           ("measure", "kvrelay (defaults)", "baseline", "baseline/kvrelay"))

    def _per_workload(self, runs: list[Run]) -> Prompts:
        """Phase 1: one session at a time, every stack; returns the prompts `prefix` rendered."""
        budget = working_set(runs, 1, self.peaks)
        reference, _, _ = self.replay("prefix", runs, 1, budget.full, None)
        self._measured(reference)
        prompts = {k: (o.body, o.quotes) for k, o in reference.outcomes.items()}
        cells = {"prefix": reference}
        stacks: list[StackName] = ["kvrelay", *APPROXIMATE, *(["vllm_apc"] if self.has_vllm else [])]
        guards: dict[str, dict[str, float]] = {}
        for stack in stacks:
            cells[stack], inference, guards[stack] = self.replay(stack, runs, 1, budget.full, prompts)
            if stack == "kvrelay" and inference is not None:
                self.metrics.update(inference.metrics())
        self._per_workload_rows(cells, guards)
        self._level_rows(cells, 1, "full", budget.full)
        return prompts

    def _measured(self, reference: Cell) -> None:
        self.peaks = {k: o.prompt_tokens + o.completion_tokens for k, o in reference.outcomes.items()}

    def _per_workload_rows(self, cells: dict[str, Cell], guards: dict[str, dict[str, float]]) -> None:
        ratios = []
        for workload in self.workloads:
            sub = {stack: Cell({k: o for k, o in cell.outcomes.items() if k[0] == workload.name})
                   for stack, cell in cells.items()}
            a, c = sub["kvrelay"], sub["prefix"]
            ratio = c.ttft_ms(0.5) / a.ttft_ms(0.5)
            ratios.append(ratio)
            name = workload.name
            for stack, cell in sub.items():
                self.metrics[f"{name}_ttft_p50_ms_{stack}"] = cell.ttft_ms(0.5)
                self.metrics[f"{name}_ttft_p95_ms_{stack}"] = cell.ttft_ms(0.95)
                self.metrics[f"{name}_cached_fraction_{stack}"] = cell.cached_fraction()
                if stack != "prefix":
                    self.metrics[f"{name}_greedy_match_{stack}"] = cell.greedy_match(c)
            self.rows.append((f"{name}: TTFT p50 ms, vs prefix caching", f"{a.ttft_ms(0.5):.0f}",
                              f"{c.ttft_ms(0.5):.0f}", f"{ratio:.3f}"))
        self.metrics["ttft_ratio_default_vs_prefix_min"] = min(ratios)
        a, c = cells["kvrelay"], cells["prefix"]
        self.metrics["greedy_match_default"] = a.greedy_match(c)
        for stack in APPROXIMATE:
            self.metrics[f"greedy_match_{stack}"] = cells[stack].greedy_match(c)
            self.metrics[f"top1_{stack}"] = guards[stack]["top1"]
            self.metrics[f"kl_{stack}"] = guards[stack]["kl"]
        self.metrics["top1_approx"] = min(guards[s]["top1"] for s in APPROXIMATE)
        if "vllm_apc" in cells:
            self._agent5(cells)

    def _agent5(self, cells: dict[str, Cell]) -> None:
        """TTFT of the fully connected team's 5th agent (it reads the most): vLLM APC vs
        the approximate stack that does best on it."""
        fifth = {r.key for w in self.workloads if w.name == "kvcomm_team" for run in w.runs
                 for r in run.requests if r.agent == fifth_agent(run)}
        if not fifth:
            return
        ttft = {stack: Cell({k: o for k, o in cell.outcomes.items() if k in fifth}).ttft_ms(0.5)
                for stack, cell in cells.items()}
        best = min(APPROXIMATE, key=lambda s: ttft[s])
        self.metrics["ttft_speedup_approx_vs_vllm_apc_agent5"] = ttft["vllm_apc"] / ttft[best]
        self.metrics["ttft_speedup_default_vs_vllm_apc_agent5"] = ttft["vllm_apc"] / ttft["kvrelay"]
        self.rows.append((f"kvcomm_team agent 5: TTFT p50 ms, {best} vs vLLM APC", f"{ttft[best]:.0f}",
                          f"{ttft['vllm_apc']:.0f}", f"{ttft['vllm_apc'] / ttft[best]:.3f}"))

    def _concurrent(self, runs: list[Run], levels: list[int], sizes: list[str], prompts: Prompts | None) -> None:
        """Phase 2: many sessions at once, kvrelay vs prefix caching vs vLLM, per budget.
        Without `prompts` (quick), the first prefix replay renders them live."""
        for level in levels:
            for size in sizes:
                budget = working_set(runs, level, self.peaks)
                tokens = budget.full if size == "full" else budget.half
                cells: dict[str, Cell] = {}
                if prompts is None:
                    cells["prefix"], _, _ = self.replay("prefix", runs, level, tokens, None)
                    self._measured(cells["prefix"])
                    prompts = {k: (o.body, o.quotes) for k, o in cells["prefix"].outcomes.items()}
                stacks: list[StackName] = ["kvrelay", "prefix", *(["vllm_apc"] if self.has_vllm else [])]
                for stack in stacks:
                    if stack not in cells:
                        cells[stack], inference, _ = self.replay(stack, runs, level, tokens, prompts)
                        if stack == "kvrelay" and inference is not None:
                            self.metrics.update(inference.metrics(f"_c{level}_{size}"))
                if self.quick:
                    # A few sessions with short answers make one replay's p50 swing by a fifth
                    # (interleavings, not the stacks); so the quick run replays defaults and prefix
                    # caching again in the reverse order (ABBA) and takes each stack's two together.
                    for stack in ("kvrelay", "prefix"):
                        repeat, _, _ = self.replay(stack, runs, level, tokens, prompts)
                        cells[stack] = cells[stack].merged(repeat)
                self._level_rows(cells, level, size, tokens)

    def _level_rows(self, cells: dict[str, Cell], level: int, size: str, tokens: int) -> None:
        a, c = cells["kvrelay"], cells["prefix"]
        tag = f"c{level}_{size}"
        ratio = c.ttft_ms(0.5) / a.ttft_ms(0.5)
        self.metrics[f"ttft_ratio_default_vs_prefix_{tag}"] = ratio
        if level == max(FULL_LEVELS) and size == "half":
            self.metrics["ttft_ratio_default_vs_prefix_pressure"] = ratio
        label = f"{level} sessions, {size} budget ({tokens} tokens)"
        for stack, cell in cells.items():
            self.metrics[f"ttft_p50_ms_{stack}_{tag}"] = cell.ttft_ms(0.5)
            self.metrics[f"ttft_p95_ms_{stack}_{tag}"] = cell.ttft_ms(0.95)
            self.metrics[f"latency_p50_ms_{stack}_{tag}"] = cell.latency_ms()
            self.metrics[f"makespan_s_{stack}_{tag}"] = cell.makespan_s(self._runs())
            self.metrics[f"throughput_tok_s_{stack}_{tag}"] = cell.throughput_tok_s()
            self.metrics[f"cached_fraction_{stack}_{tag}"] = cell.cached_fraction()
            self.metrics[f"errors_{stack}_{tag}"] = float(cell.errors)
        self.metrics[f"greedy_match_default_{tag}"] = a.greedy_match(c)
        for stack, cell in cells.items():
            if stack == "kvrelay":
                continue
            self.rows += [
                (f"{label}: TTFT p50 ms vs {stack}", f"{a.ttft_ms(0.5):.0f}", f"{cell.ttft_ms(0.5):.0f}",
                 f"{cell.ttft_ms(0.5) / a.ttft_ms(0.5):.3f}"),
                (f"{label}: TTFT p95 ms vs {stack}", f"{a.ttft_ms(0.95):.0f}", f"{cell.ttft_ms(0.95):.0f}",
                 f"{cell.ttft_ms(0.95) / a.ttft_ms(0.95):.3f}"),
                (f"{label}: session makespan s vs {stack}", f"{a.makespan_s(self._runs()):.1f}",
                 f"{cell.makespan_s(self._runs()):.1f}", f"{cell.makespan_s(self._runs()) / a.makespan_s(self._runs()):.3f}"),
                (f"{label}: prompt share from cache vs {stack}", f"{a.cached_fraction():.3f}",
                 f"{cell.cached_fraction():.3f}", ""),
            ]

    def _runs(self) -> list[Run]:
        return [run for w in self.workloads for run in w.runs]

    def _config(self) -> dict[str, Any]:
        return {"quick": self.quick, "model": str(self.model_dir), "workloads": {
            w.name: {"framework": w.framework, "runs": len(w.runs), "requests": len(w.requests)}
            for w in self.workloads}, "levels": [1, *FULL_LEVELS] if not self.quick else [len(self._runs())],
            "ttft": "client-side, streamed, time to the first content or tool-call delta",
            "prompts": "rendered once by the prefix stack (live answers), then sent as they are to every stack",
            "notes": self.notes}


@dataclass(frozen=True)
class Budget:
    full: int
    half: int


def working_set(runs: list[Run], concurrency: int, peaks: dict[Key, int]) -> Budget:
    """KV tokens that hold `concurrency` sessions at their largest: the sum of the
    longest request (prompt plus answer) of that many largest runs; half of it, but
    never less than the longest request needs. Before any
    replay has measured them, a generous character-based estimate (4 chars per token)."""
    per_run = sorted((max(peaks.get(r.key, estimate_tokens(r.body)) for r in run.requests) for run in runs), reverse=True)
    full = sum(per_run[:concurrency]) + 256
    return Budget(full, max(full // 2, per_run[0] + 256))  # the longest request must still fit


def estimate_tokens(body: dict[str, Any]) -> int:
    chars = sum(len(str(m.get("content") or "")) for m in body.get("messages", []))
    return chars // 3 + int(body.get("max_tokens") or body.get("max_completion_tokens") or 64) + 64


def agent_order(run: Run) -> list[str]:
    """The run's agents in the order they first sent a request: agent 1, agent 2, ..."""
    agents: list[str] = []
    for request in run.requests:
        if request.agent not in agents:
            agents.append(request.agent)
    return agents


def fifth_agent(run: Run) -> str | None:
    agents = agent_order(run)
    return agents[4] if len(agents) >= 5 else None


def interleaved(workloads: list[Workload]) -> list[Run]:
    """Runs of all workloads, taking one of each in turn, so sessions in flight together mix apps."""
    queues = [list(w.runs) for w in workloads]
    out: list[Run] = []
    while any(queues):
        out += [q.pop(0) for q in queues if q]
    return out


def quick_subset(workloads: list[Workload], runs: dict[str, int] = QUICK_RUNS) -> list[Workload]:
    """Each workload cut to its first `runs[name]` runs."""
    return [Workload(w.name, w.framework, w.description, w.runs[:runs[w.name]]) for w in workloads]


def run(quick: bool = False, model: str | None = None, family: str = "short") -> BenchResult:
    if family not in FAMILIES:
        raise ValueError(f"bench agents: no family {family!r}; families: {', '.join(FAMILIES)}")
    from benchmarks.agents.long import LongBench  # it builds on this module

    bench = LongBench if family == "long" else Bench
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-agents-") as tmp:
        return bench(quick, model, Path(tmp)).run()
