"""`kvrelay bench agents --family long`: the long-context captures, where reuse has
something to win.

The short family's prompts are a few hundred tokens and its answers 48, so there is
little to reuse. The long family (tests/data/agents/long, captured like the short one)
gives each task a passage of about 850 tokens, every agent its own ~600-character
persona and answers up to 128 tokens, so a board's fifth agent reads about 1,500
tokens, most of them text an earlier request already computed behind another prefix.

Per workload, one session at a time, every stack freshly started (so no workload warms
another's caches): `prefix` first, live (it renders the prompts), then `kvrelay`
(defaults, exact) and prefix caching again (`prefix_in_turns`), those two up together
and taking turns task by task over the rendered prompts (`ttft_ratio_default_vs_prefix`
compares them: stacks run minutes apart differ by more than what is measured), then
`kvrelay_kvcomm` and `kvrelay_blend` (opted in by a gateway rule,
the guard at its shipped sample rate), `kvrelay_kvcomm_probed` and
`kvrelay_blend_probed` (every opted-in request probed: the guard's figures over every
request), `kvrelay_kvcomm_unguarded` (none probed: with the probed one, the guard's
cost; those two run side by side, taking turns task by task), `kvrelay_blend_single` (blend with collective prefill off, on workloads with
All-Gather rounds only: TokenDance's baseline), and `vllm_apc` where its venv exists.
The exact stacks read `prefix`'s prompts as they are. An approximate stack's answers
differ from the engine alone's now and then, and an app quotes the answers it got: so
the opted-in stacks replay live, each quoting its own answers (a prompt quoting text
the stack never relayed would be a workload no user sends). Their greedy match is over
the requests whose prompt came out identical to `prefix`'s. A
workload's first task is its warm-up (cold caches, agents not seen yet); the headline
figures are over the other, warm tasks, and the warm-up's carry a `_warmup` suffix.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.agents.bench import Bench, Cell, Prompts, agent_order, quick_subset
from benchmarks.agents.replay import Key, Outcome, Replay
from benchmarks.agents.stacks import (MODEL, Running, StackName, engine_counters, fidelity, method_of, started,
                                      wait_background)
from benchmarks.agents.workload import CAPTURES, Run, Workload, load_all
from benchmarks.common import BenchResult
from benchmarks.stack import kv_bytes_per_token
from engine_ext.diffs.stored import MirrorRows
from kvrelay.gateway.approximation import GuardSettings
from kvrelay.engine_settings import EngineSettings

LONG_CAPTURES = CAPTURES / "long"
QUICK_RUNS = {"board_openai": 2}  # the quick subset: a warm-up task and one warm task
QUICK_MAX_TOKENS = 24
STACKS: tuple[StackName, ...] = ("kvrelay", "kvrelay_kvcomm", "kvrelay_blend", "kvrelay_kvcomm_probed",
                                 "kvrelay_blend_probed", "kvrelay_kvcomm_unguarded", "kvrelay_blend_single")
ROUND_SIZE = 10  # TokenDance's figures are over All-Gather rounds of at least this many requests
# The guard's cost: every request probed, and none; replayed in turns (LongBench._guard_pair).
GUARD_PAIR: tuple[StackName, StackName] = ("kvrelay_kvcomm_probed", "kvrelay_kvcomm_unguarded")
QUICK_STACKS: tuple[StackName, ...] = ("kvrelay", "kvrelay_kvcomm")
# Prefix caching replayed in turns with the defaults, over the prompts the live `prefix` run rendered.
PAIRED_PREFIX = "prefix_in_turns"
OPT_IN: dict[str, StackName] = {"kvcomm": "kvrelay_kvcomm", "blend": "kvrelay_blend"}  # at the shipped guard rate
PROBED: dict[str, StackName] = {"kvcomm": "kvrelay_kvcomm_probed", "blend": "kvrelay_blend_probed"}
AGENTS = 5  # agents 1..5 of a run, by their first request
HEADERS = ("measure (warm tasks)", "stack", "reference", "reference/stack")
# (stack, reference, what): each ratio reads reference/stack, as the metric of that name does.
COMPARISONS: tuple[tuple[str, str, str], ...] = (
    ("kvrelay", PAIRED_PREFIX, "kvrelay defaults vs prefix caching (in turns)"),
    ("kvrelay_kvcomm", "kvrelay", "kvcomm opt-in vs kvrelay defaults"),
    ("kvrelay_blend", "kvrelay", "blend opt-in vs kvrelay defaults"),
    ("kvrelay_kvcomm", "vllm_apc", "kvcomm opt-in vs vLLM APC"),
    ("kvrelay_kvcomm_unguarded", "kvrelay_kvcomm_probed", "guard cost: kvcomm unguarded vs every request probed"),
)


class LongBench(Bench):
    guard_rate = GuardSettings().sample_rate  # what a user who opts in gets

    def __init__(self, quick: bool, model: str | None, log_dir: Path) -> None:
        super().__init__(quick, model, log_dir)
        self.counters: dict[tuple[str, str], dict[str, float]] = {}  # (workload, stack) -> its engine's counters

    def _workloads(self) -> list[Workload]:
        if self.quick:
            return quick_subset(load_all(LONG_CAPTURES, names=list(QUICK_RUNS)), QUICK_RUNS)
        return load_all(LONG_CAPTURES)

    def _max_tokens(self) -> int | None:
        return QUICK_MAX_TOKENS if self.quick else None

    def _guard_settle_s(self, runs: list[Run]) -> float:
        """Long prompts, and every request probed on the `_probed` stacks: the probes run
        on the engine's idle time, mostly after the replay, a few seconds each."""
        return max(120.0, 15.0 * sum(len(run.requests) for run in runs))

    def stacks(self) -> list[StackName]:
        """The stacks after `prefix`; vLLM only in the full run, where its venv exists."""
        if self.quick:
            return list(QUICK_STACKS)
        stacks = list(STACKS)
        if self.has_vllm:
            stacks.append("vllm_apc")
        return stacks

    # -- the bench -------------------------------------------------------------------------
    def run(self) -> BenchResult:
        outcomes: dict[str, dict[Key, Outcome]] = defaultdict(dict)
        guards: dict[str, list[dict[str, float]]] = defaultdict(list)
        for workload in self.workloads:
            self._workload(workload, outcomes, guards)
        cells = {stack: Cell(done) for stack, done in outcomes.items()}
        warm, warmup = self._warm_keys()
        self._figures(cells, warm)
        self._figures(cells, warmup, suffix="_warmup")
        for workload in self.workloads:
            self._figures(cells, warm & {r.key for r in workload.requests}, prefix=f"{workload.name}_")
        self._per_stack(cells, warm)
        self._guard(guards)
        self._rounds(cells)
        self._rows(cells, warm)
        if not self.has_vllm and not self.quick:
            self.notes.append("vLLM skipped: no vLLM venv (make vllm-venv)")
            self._progress(self.notes[-1])
        return BenchResult("agents", self.metrics, self._config(), self.rows, HEADERS)

    def _workload(self, workload: Workload, outcomes: dict[str, dict[Key, Outcome]],
                  guards: dict[str, list[dict[str, float]]]) -> None:
        """Every stack on one workload's runs, one session at a time: `prefix` live first,
        then its prompts as they are to the others."""
        runs = list(workload.runs)
        budget = default_budget(str(self.model_dir))
        reference, _, _ = self.replay("prefix", runs, 1, budget, None)
        outcomes["prefix"].update(reference.outcomes)
        prompts = {k: (o.body, o.quotes) for k, o in reference.outcomes.items()}
        stacks = self.stacks()
        self._default_pair(workload, runs, budget, prompts, outcomes)
        if set(GUARD_PAIR) <= set(stacks):
            self._guard_pair(runs, budget, outcomes, guards)
            self.metrics.update(workload_guard(workload.name, GUARD_PAIR[0], guards[GUARD_PAIR[0]][-1]))
        for stack in stacks:
            if stack == "kvrelay":
                continue  # in turns with prefix caching, above
            if stack == "kvrelay_blend_single" and not big_rounds(runs[1:]):
                continue  # collective prefill off: only a workload with All-Gather rounds tells it apart
            if stack in GUARD_PAIR:
                continue
            live = method_of(stack) is not None  # an approximate stack quotes its own answers
            cell, inference, guard = self.replay(stack, runs, 1, budget, None if live else prompts)
            if stack in self.engine_counters:
                self.counters[workload.name, stack] = self.engine_counters[stack]
            outcomes[stack].update(cell.outcomes)
            if guard:
                guards[stack].append(guard)
                self.metrics.update(workload_guard(workload.name, stack, guard))

    def _in_turns(self, pair: tuple[tuple[str, StackName], tuple[str, StackName]], runs: list[Run], budget: int,
                  fixed: Prompts | None, outcomes: dict[str, dict[Key, Outcome]],
                  settle: Callable[[dict[str, Running]], None]) -> None:
        """Two stacks up together, (label, stack) each, taking turns task by task in ABBA
        order, each turn starting once the other engine has no probe left to run; each
        label's outcomes go to `outcomes[label]`. Two stacks run one after the other differ
        by up to ~20% in TTFT on this machine, more than the differences measured; taking
        turns puts that drift on both alike, and no probe runs on the other stack's time.
        Inside a task a probed stack's probes run in the chain's gaps, as in a busy app.
        `settle` reads what it needs from the running stacks before they stop."""
        try:
            with ExitStack() as stack:
                running = {label: stack.enter_context(started(name, self.model_dir, budget, self.log_dir,
                                                               guard_rate=self.guard_rate)) for label, name in pair}
                for index, run in enumerate(runs):
                    for label, _ in pair if index % 2 == 0 else pair[::-1]:
                        for other, up in running.items():
                            if other != label and up.engine_url and not wait_background(up.engine_url):
                                raise RuntimeError(f"{other}'s probes did not finish")
                        replay = Replay(running[label].url, MODEL, [run], 1, fixed, max_tokens=self._max_tokens())
                        outcomes[label].update(replay.run())
                settle(running)
        except RuntimeError as exc:  # a stack that would not start: one line for the CLI
            raise ValueError(f"bench agents: {' and '.join(label for label, _ in pair)}: {exc}") from exc
        keys = {request.key for run in runs for request in run.requests}
        for label, _ in pair:
            cell = Cell(outcomes[label]).only(keys)
            self._progress(f"{label} (in turns): {len(cell.outcomes)} requests, {cell.errors} errors; "
                           f"TTFT p50 {cell.ttft_ms(0.5):.0f} ms, {cell.cached_fraction():.3f} of prompt tokens "
                           "from cache")

    def _default_pair(self, workload: Workload, runs: list[Run], budget: int, prompts: Prompts,
                      outcomes: dict[str, dict[Key, Outcome]]) -> None:
        """The defaults against prefix caching, in turns over the prompts `prefix` rendered:
        `ttft_ratio_default_vs_prefix` compares these two (PAIRED_PREFIX is the second)."""
        keys = {request.key for run in runs for request in run.requests}

        def settle(running: dict[str, Running]) -> None:
            defaults = running["kvrelay"]
            inference = self._inference(defaults, Cell(outcomes["kvrelay"]).only(keys))
            if inference is not None:
                self.metrics.update(inference.metrics(f"_{workload.name}"))
            if defaults.engine_url is not None:
                self.counters[workload.name, "kvrelay"] = engine_counters(defaults.engine_url)

        self._in_turns((("kvrelay", "kvrelay"), (PAIRED_PREFIX, "prefix")), runs, budget, prompts, outcomes, settle)

    def _guard_pair(self, runs: list[Run], budget: int, outcomes: dict[str, dict[Key, Outcome]],
                    guards: dict[str, list[dict[str, float]]]) -> None:
        """The guard's cost: `kvrelay_kvcomm_probed` and `_unguarded` in turns, both live."""
        probed = GUARD_PAIR[0]

        def settle(running: dict[str, Running]) -> None:
            guards[probed].append(fidelity(running[probed].url, "kvcomm", self._guard_settle_s(runs)))

        self._in_turns(((GUARD_PAIR[0], GUARD_PAIR[0]), (GUARD_PAIR[1], GUARD_PAIR[1])), runs, budget, None,
                       outcomes, settle)

    # -- which requests ----------------------------------------------------------------------
    def _warm_keys(self) -> tuple[set[Key], set[Key]]:
        """(warm tasks, warm-up tasks): each workload's first run is its warm-up."""
        warm = {r.key for w in self.workloads for run in w.runs[1:] for r in run.requests}
        warmup = {r.key for w in self.workloads for r in w.runs[0].requests}
        return warm, warmup

    def _agent_keys(self, index: int) -> set[Key]:
        """The requests of each run's `index`-th agent (1-based, by first request)."""
        return {r.key for run in self._runs() for r in run.requests if agent_of(run, index) == r.agent}

    def _agent_means(self, cell: Cell) -> list[float]:
        return [cell.only(self._agent_keys(i)).ttft_mean_ms() for i in range(1, AGENTS + 1)]

    # -- metrics and rows --------------------------------------------------------------------
    def _figures(self, cells: dict[str, Cell], keys: set[Key], prefix: str = "", suffix: str = "") -> None:
        """The headline figures over `keys` (the warm tasks, the warm-up ones, one
        workload's warm tasks), named `{prefix}NAME{suffix}`."""
        sub = {stack: cell.only(keys) for stack, cell in cells.items()}
        agent5 = {stack: cell.only(self._agent_keys(5)).ttft_mean_ms() for stack, cell in sub.items()}
        default, plain = sub["kvrelay"], sub["prefix"]
        figures = {"ttft_ratio_default_vs_prefix": sub[PAIRED_PREFIX].ttft_ms(0.5) / default.ttft_ms(0.5),
                   "reuse_rate_default": default.cached_fraction(), "reuse_rate_prefix": plain.cached_fraction(),
                   "greedy_match_default": default.greedy_match(plain)}
        for method, stack in OPT_IN.items():
            if stack in sub:
                figures[f"agent5_speedup_{method}"] = agent5["kvrelay"] / agent5[stack]
                figures[f"reuse_rate_{method}"] = sub[stack].cached_fraction()
                figures[f"greedy_match_{method}"] = sub[stack].greedy_match(plain, same_prompt=True)
                figures[f"greedy_compared_{method}"] = float(sub[stack].num_same_prompt(plain))
        if {"vllm_apc", "kvrelay_kvcomm"} <= sub.keys():
            figures["agent5_speedup_vs_vllm_apc"] = agent5["vllm_apc"] / agent5["kvrelay_kvcomm"]
        if {"kvrelay_kvcomm_probed", "kvrelay_kvcomm_unguarded"} <= sub.keys():
            figures["guard_cost_ttft"] = (sub["kvrelay_kvcomm_probed"].ttft_ms(0.5)
                                          / sub["kvrelay_kvcomm_unguarded"].ttft_ms(0.5))
        self.metrics.update({f"{prefix}{name}{suffix}": value for name, value in figures.items()})

    def _per_stack(self, cells: dict[str, Cell], warm: set[Key]) -> None:
        """Each stack's TTFT (p50, per agent) over the warm tasks, its errors over all, and
        how long agent 5's prompts are (what the family is about)."""
        for stack, cell in cells.items():
            mine = cell.only(warm)
            self.metrics[f"ttft_p50_ms_{stack}"] = mine.ttft_ms(0.5)
            for index, mean in enumerate(self._agent_means(mine), start=1):
                self.metrics[f"ttft_mean_ms_agent{index}_{stack}"] = mean
            self.metrics[f"errors_{stack}"] = float(cell.errors)
        fifth = cells["prefix"].only(warm & self._agent_keys(5)).ok()
        self.metrics["prompt_tokens_agent5_mean"] = statistics.fmean(o.prompt_tokens for o in fifth) if fifth else 0.0

    def _guard(self, guards: dict[str, list[dict[str, float]]]) -> None:
        """The guard's teacher-forced figures where it probed every request, and its
        decisions at the shipped rate; pooled over the workloads (each its own stack)."""
        for method, stack in PROBED.items():
            pooled = pool(guards.get(stack, []))
            if pooled["scores"]:
                self.metrics[f"top1_{method}"], self.metrics[f"kl_{method}"] = pooled["top1"], pooled["kl"]
                self.metrics[f"probe_scores_{method}"] = pooled["scores"]
        for method, stack in OPT_IN.items():
            if stack in guards:
                pooled = pool(guards[stack])
                self.metrics[f"switch_offs_{method}"] = pooled["switch_offs"]
                self.metrics[f"guard_scores_{method}"] = pooled["scores"]

    def _rounds(self, cells: dict[str, Cell]) -> None:
        """TokenDance on plain traffic: over the warm All-Gather rounds of ROUND_SIZE or
        more requests (ground truth from the captures), the time from a round's first
        request sent to its last member's first token, blend placed request by request
        (`kvrelay_blend_single`) over blend with the round prefilled collectively; and,
        from the collective stack's engine counters (every task of those workloads), the
        rounds it prefilled collectively, its mirrors' bytes over dense, and the rows the
        mirrors hold by why (`mirror_unshared_fraction`: text no master holds, the floor of
        a lossless mirror)."""
        if not {"kvrelay_blend", "kvrelay_blend_single"} <= cells.keys():
            return
        rounds = [keys for w in self.workloads for keys in big_rounds(w.runs[1:])]
        if not rounds:
            return
        spans = {stack: statistics.fmean(round_span_ms(cells[stack], keys) for keys in rounds)
                 for stack in ("kvrelay_blend", "kvrelay_blend_single")}
        self.metrics["collective_speedup_round10"] = spans["kvrelay_blend_single"] / spans["kvrelay_blend"]
        for stack, span in spans.items():
            self.metrics[f"round_prefill_ms_{stack}"] = span
        self.metrics["rounds_scored"] = float(len(rounds))
        collective = [c for (w, stack), c in self.counters.items()
                      if stack == "kvrelay_blend" and big_rounds(next(x for x in self.workloads if x.name == w).runs)]
        self.metrics["collective_rounds"] = sum(c.get("kvrelay_engine_collective_rounds_total", 0.0) for c in collective)
        dense = sum(c.get("kvrelay_engine_round_mirrored_dense_bytes_total", 0.0) for c in collective)
        if dense:
            self.metrics["mirror_fraction"] = sum(c.get("kvrelay_engine_round_mirror_bytes_total", 0.0)
                                                  for c in collective) / dense
        rows = sum(c.get("kvrelay_engine_round_mirrored_rows_total", 0.0) for c in collective)
        for cause in MirrorRows._fields if rows else ():  # what the mirrors hold, over their caches' rows
            self.metrics[f"mirror_{cause}_fraction"] = sum(
                c.get(f'kvrelay_engine_round_mirror_rows_total{{cause="{cause}"}}', 0.0) for c in collective) / rows
        self.rows.append(_ratio_row(f"rounds of {ROUND_SIZE}+: first request sent to last first token, ms "
                                    "(blend collective vs one by one)", spans["kvrelay_blend"],
                                    spans["kvrelay_blend_single"]))

    def _rows(self, cells: dict[str, Cell], warm: set[Key]) -> None:
        sub = {stack: cell.only(warm) for stack, cell in cells.items()}
        fifth = self._agent_keys(5)
        for stack, reference, what in COMPARISONS:
            if stack in sub and reference in sub:
                self.rows += [_ratio_row(f"{what}: TTFT p50 ms", sub[stack].ttft_ms(0.5), sub[reference].ttft_ms(0.5)),
                              _ratio_row(f"{what}: agent 5 TTFT mean ms", sub[stack].only(fifth).ttft_mean_ms(),
                                         sub[reference].only(fifth).ttft_mean_ms())]
        defaults = self._agent_means(sub["kvrelay"])
        for stack, cell in sub.items():
            if stack == "kvrelay":
                continue  # the reference column of every row below
            means = self._agent_means(cell)
            self.rows += [
                (f"{stack} vs kvrelay: TTFT mean ms, agents 1/2/3/4/5", "/".join(f"{m:.0f}" for m in means),
                 "/".join(f"{m:.0f}" for m in defaults), ""),
                (f"{stack} vs kvrelay: prompt share from cache", f"{cell.cached_fraction():.3f}",
                 f"{sub['kvrelay'].cached_fraction():.3f}", ""),
                (f"{stack} vs kvrelay: greedy match with prefix", f"{cell.greedy_match(sub['prefix']):.3f}",
                 f"{sub['kvrelay'].greedy_match(sub['prefix']):.3f}", ""),
            ]

    def _config(self) -> dict[str, Any]:
        return {
            "family": "long", "quick": self.quick, "model": str(self.model_dir),
            "workloads": {w.name: {"framework": w.framework, "runs": len(w.runs), "requests": len(w.requests),
                                   "kv_tokens": default_budget(str(self.model_dir))} for w in self.workloads},
            "stacks": ["prefix", *self.stacks()],
            "max_tokens": self._max_tokens() or "as captured",
            "guard": {stack: self._guard_setup(stack) for stack in self.stacks() if method_of(stack) is not None},
            "warm": "every run but each workload's first; `_warmup` metrics: the first runs; guard figures "
                    "cover every run",
            "sessions": "one at a time, each workload on freshly started stacks",
            "ttft": "client-side, streamed, time to the first content or tool-call delta",
            "prompts": "rendered once by the prefix stack (live answers), then sent as they are to every stack",
            "notes": self.notes}

    def _guard_setup(self, stack: str) -> str:
        """How the stack's guard was set, and the metrics it gives."""
        if stack in PROBED.values():
            return "sample rate 1.0, floors off so the method stays on (top1_*, kl_*, probe_scores_*)"
        if stack == "kvrelay_kvcomm_unguarded":
            return ("sample rate 0 (guard_cost_ttft: probed p50 / unguarded p50, the two replayed in turns, "
                    "task by task)")
        return f"shipped sample rate {self.guard_rate} and floors (switch_offs_*, guard_scores_*)"


def agent_of(run: Run, index: int) -> str | None:
    agents = agent_order(run)
    return agents[index - 1] if len(agents) >= index else None


def big_rounds(runs: list[Run]) -> list[set[Key]]:
    """The ground-truth All-Gather rounds of at least ROUND_SIZE requests in `runs`."""
    rounds: dict[tuple[str, str], set[Key]] = defaultdict(set)
    for run in runs:
        for request in run.requests:
            if request.round is not None:
                rounds[request.run, request.round].add(request.key)
    return [keys for keys in rounds.values() if len(keys) >= ROUND_SIZE]


def round_span_ms(cell: Cell, keys: set[Key]) -> float:
    """From the round's first request sent to its last member's first token."""
    members = cell.only(keys).ok()
    return 1000.0 * (max(o.started_s + o.ttft_s for o in members) - min(o.started_s for o in members))


def default_budget(model_dir: str) -> int:
    """KV tokens of `kvrelay up`'s default `--kv-cache-mb`: what a user runs. Reuse
    beyond the prefix keeps more than prompts (segment index entries, KVCOMM's offsets
    per reader), so a budget cut to the prompts' working set would measure eviction,
    not reuse; every stack gets the same."""
    return EngineSettings().kv_cache_mb * 2**20 // kv_bytes_per_token(model_dir)


def workload_guard(workload: str, stack: str, guard: dict[str, float]) -> dict[str, float]:
    """A probed stack's guard figures on one workload (`board_openai_kl_kvcomm`, ...): the
    pooled `kl_kvcomm` averages workloads whose fidelity differs severalfold."""
    method = next((m for m, probed in PROBED.items() if probed == stack), None)
    if method is None or not guard.get("scores"):
        return {}
    return {f"{workload}_top1_{method}": guard.get("top1", 0.0), f"{workload}_kl_{method}": guard.get("kl", 0.0),
            f"{workload}_probe_scores_{method}": guard["scores"]}


def pool(guards: list[dict[str, float]]) -> dict[str, float]:
    """Several stacks' guard figures as one: top-1 and KL weighted by their scores."""
    scores = sum(g.get("scores", 0.0) for g in guards)
    weighted = {name: sum(g.get(name, 0.0) * g.get("scores", 0.0) for g in guards) / scores if scores else 0.0
                for name in ("top1", "kl")}
    return {**weighted, "scores": scores, "switch_offs": sum(g.get("switch_offs", 0.0) for g in guards)}


def _ratio_row(measure: str, stack: float, reference: float) -> tuple[str, str, str, str]:
    return measure, f"{stack:.0f}", f"{reference:.0f}", f"{reference / stack:.3f}"
