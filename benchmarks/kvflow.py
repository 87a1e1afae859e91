"""`kvrelay bench kvflow`: KVFlow's workflows on SmolLM2, with a device tier too small for them.

Each workflow is a cycle of agents run one after another (KVFlow's 10-agent sequential
workflow): agent i's prompt is its fixed prompt (its own tokens, 1k-4k in the full run)
then a fresh dynamic part, and it writes a fixed number of tokens; then agent i+1 runs.
Every request carries what the gateway's plan would: the app, the agent, its fixed
prefix segment and the step graph's steps-to-execution. Several workflows run
concurrently without sharing anything. The device tier (the KV pool) holds about half
of all fixed prefixes, so something must be evicted at every step.

One workload is several sessions of one app instead (the same agents, each session
starting at its own step of the cycle): KVFlow keeps steps-to-execution per session, so
after every request each session's next agent, taken from the script (never from the
policy), must be ranked within load_ahead (the prefetcher's list). The fraction of such
checks is `next_agent_within_load_ahead`.

Policies, each on its own engine, after one untimed warm-up cycle (the timed cycles
alternate between the engines):
- lru_recompute: LRU eviction, no lower tier (an evicted prefix is recomputed);
- lru_reactive: LRU, every block backed up to the lower tier, loaded back when its
  request is admitted (SGLang's HiCache);
- kvflow: workflow-aware eviction, prefetch of the agents <= 2 steps away, and the
  scheduler runs ready requests while a prefix is loading.
The lower tier is host memory or a memory-mapped file on disk (read back from the
disk, not the page cache). Timed: end-to-end time of the workflows' cycles.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.common import BenchResult
from engine_ext.config import EngineConfig, ModelConfig, ReuseConfig, TierConfig
from engine_ext.engine import LLMEngine
from engine_ext.model_store import resolve_model
from kvrelay.wire.plan import WorkflowInfo
from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.sampling import SamplingParams
from engine_ext.sequence import Sequence
from engine_ext.tiers import AgentKey
from engine_ext.request import EngineRequest

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    label: str
    num_workflows: int
    num_agents: int
    fixed_tokens: tuple[int, int]  # fixed prompt lengths, spread evenly over this range
    dynamic_tokens: int
    output_tokens: int
    num_cycles: int  # timed cycles of every workflow, after the warm-up cycle
    lower_tiers: tuple[str, ...]  # "host" and/or "disk"
    device_fraction: float = 0.5  # device tier / all fixed prefixes' KV
    sessions: bool = False  # the workflows are sessions of one app, out of phase (same agents, same prompts)

    @property
    def num_prefix_sets(self) -> int:
        """Distinct sets of agents' fixed prompts: one per workflow, or one for the app."""
        return 1 if self.sessions else self.num_workflows

    def phase(self, workflow: int) -> int:
        """Where the workflow starts in the agents' cycle: sessions are spread over it."""
        return workflow * self.num_agents // self.num_workflows if self.sessions else 0


@dataclass(frozen=True)
class Sizes:
    workloads: tuple[Workload, ...]


QUICK = Sizes(workloads=(
    Workload("1 workflow", 1, 8, (96, 256), 32, 4, 1, ("disk",)),
    Workload("4 workflows", 4, 3, (48, 96), 16, 4, 1, ("disk",)),
    Workload("3 sessions of one app", 3, 6, (48, 96), 16, 4, 2, ("host",), sessions=True),
))
FULL = Sizes(workloads=(
    Workload("1 workflow", 1, 10, (1024, 4096), 32, 32, 1, ("host", "disk")),
    Workload("8 workflows", 8, 10, (256, 512), 32, 32, 1, ("disk",)),
    Workload("32 workflows", 32, 10, (64, 128), 32, 32, 1, ("disk",)),
    Workload("3 sessions of one app", 3, 6, (256, 512), 32, 32, 2, ("host",), sessions=True),
))


class Finished(NamedTuple):
    seq: Sequence
    num_fixed: int  # tokens of its fixed prompt
    seconds: float  # from submission to its last token


@dataclass
class PolicyRun:
    seconds: float  # the timed cycles, end to end
    requests: list[Finished]
    fetch_seconds: float  # admissions' synchronous loads from the lower tier
    num_fetched_blocks: int
    num_prefetched_blocks: int
    due_checks: list[bool] = dataclasses.field(default_factory=list)  # next agent within load_ahead, per check

    @property
    def hit_rate(self) -> float:
        """Timed requests whose fixed prefix was all on the device tier when admitted
        (loaded ahead counts; loaded at admission or recomputed does not)."""
        hits = [f for f in self.requests
                if f.seq.num_cached_tokens - f.seq.num_fetched_tokens >= f.num_fixed // BLOCK_SIZE * BLOCK_SIZE]
        return len(hits) / len(self.requests)

    @property
    def mean_step_seconds(self) -> float:
        return statistics.mean(f.seconds for f in self.requests)

    def same_outputs(self, other: PolicyRun) -> bool:
        """Whether every request generated exactly the tokens it did under `other`."""
        mine = {f.seq.request_id: f.seq.output_token_ids for f in self.requests}
        theirs = {f.seq.request_id: f.seq.output_token_ids for f in other.requests}
        return mine == theirs


class Cycles(NamedTuple):
    seconds: float
    requests: list[Finished]
    due_checks: list[bool]  # after each request: was each workflow's next agent within load_ahead


class WorkflowSet:
    """The workload's prompts and its driver: each workflow submits its next agent's
    request as soon as the previous one finishes."""

    def __init__(self, load: Workload, vocab_size: int, seed: int = 0) -> None:
        self.load = load
        self.rng = random.Random(seed)
        lo, hi = load.fixed_tokens
        lengths = [lo + (hi - lo) * i // max(load.num_agents - 1, 1) for i in range(load.num_agents)]
        self.vocab = (min(1000, vocab_size // 2), vocab_size - 1)  # clear of special tokens
        prefix_sets = [[self._tokens(n) for n in lengths] for _ in range(load.num_prefix_sets)]
        self.fixed = [prefix_sets[w % load.num_prefix_sets] for w in range(load.num_workflows)]
        self.names = [f"agent{i}" for i in range(load.num_agents)]

    def scope(self, workflow: int, agent: int) -> ReuseScope:
        """What the gateway's plan says of the request: app, agent, session, and the step
        graph's steps-to-execution from this workflow's own position."""
        n = self.load.num_agents
        steps = {self.names[(agent + k) % n]: k for k in range(n)}
        info = WorkflowInfo(steps_to_execution=steps, next=[self.names[(agent + 1) % n]])
        if self.load.sessions:
            return ReuseScope("app", self.names[agent], None, info, session_id=f"session{workflow}")
        return ReuseScope(f"workflow{workflow}", self.names[agent], None, info)

    def due_checks(self, engine: LLMEngine, position: list[int]) -> list[bool]:
        """Ground truth against the engine's ranking: for each workflow, whether the agent it
        runs next (from the script: `position`) is within load_ahead in the prefetcher's list."""
        if engine.prefetcher is None:
            return []
        due = {u.agent for u in engine.workflows.upcoming(engine.prefetcher.load_ahead)}
        scopes = [self.scope(w, p % self.load.num_agents) for w, p in enumerate(position)]
        return [AgentKey(scope.app_id, scope.agent_id or "") in due for scope in scopes]

    def _tokens(self, n: int, rng: random.Random | None = None) -> list[int]:
        return [(rng or self.rng).randint(*self.vocab) for _ in range(n)]

    def run(self, engine: LLMEngine, num_cycles: int, first_cycle: int = 0) -> Cycles:
        """Run `num_cycles` cycles of every workflow at once: the wall time, the requests
        and the due checks. A request's dynamic part depends only on its workflow, cycle
        and agent, so every policy runs the very same prompts."""
        load = self.load
        sampling = SamplingParams(max_tokens=load.output_tokens, temperature=0.0, ignore_eos=True)
        remaining = [num_cycles * load.num_agents] * load.num_workflows
        position = [first_cycle * load.num_agents + load.phase(w) for w in range(load.num_workflows)]
        done: list[Finished] = []
        checks: list[bool] = []
        running: dict[str, tuple[int, Sequence, int, float]] = {}

        def submit(w: int) -> None:
            turn = position[w]
            agent = turn % load.num_agents
            fixed = self.fixed[w][agent]
            scope = self.scope(w, agent)
            prompt = fixed + self._tokens(load.dynamic_tokens, random.Random(f"{w}/{turn}"))
            segments = [TokenSegment(0, len(fixed), "fixed_prefix", self.names[agent]),
                        TokenSegment(len(fixed), len(prompt), "private")]
            request_id = f"workflow{w}-turn{turn}"
            seq = engine.add_request(EngineRequest(request_id, prompt, sampling, segments=segments, scope=scope))
            running[request_id] = (w, seq, len(fixed), time.perf_counter())
            position[w] += 1
            remaining[w] -= 1

        start = time.perf_counter()
        for w in range(load.num_workflows):
            submit(w)
        while running:
            for out in engine.step():
                if out.finished:
                    w, seq, num_fixed, submitted = running.pop(out.request_id)
                    done.append(Finished(seq, num_fixed, time.perf_counter() - submitted))
                    checks += self.due_checks(engine, position)  # before the next plan says it
                    if remaining[w]:
                        submit(w)
        return Cycles(time.perf_counter() - start, done, checks)


def _tiers(policy: str, lower: str, disk_dir: str, lower_bytes: int) -> TierConfig:
    """Each policy spelled out in full: the defaults (KVFlow, an automatic host tier) are none of them."""
    if policy == "lru_recompute":
        return TierConfig(policy="lru", host_bytes=0)
    placement: dict[str, Any] = ({"host_bytes": lower_bytes} if lower == "host" else
                                 {"host_bytes": 0, "disk_path": disk_dir, "disk_bytes": lower_bytes})
    if policy == "lru_reactive":
        return TierConfig(policy="lru", **placement)
    return TierConfig(policy="workflow", load_ahead=2, **placement)


class PolicyBench:
    """One policy on its own engine: warmed up by one cycle, then timed cycle by cycle,
    so the caller can alternate policies (drift on a noisy machine hits all alike)."""

    def __init__(self, model_dir: Path, load: Workload, policy: str, lower: str) -> None:
        model_cfg = ModelConfig.from_dir(model_dir)
        bytes_per_token = model_cfg.kv_bytes_per_token(4)  # fp32
        lo, hi = load.fixed_tokens
        fixed_tokens = load.num_prefix_sets * load.num_agents * (lo + hi) // 2
        running = load.num_workflows * (load.dynamic_tokens + load.output_tokens + 2 * BLOCK_SIZE)
        device_tokens = int(load.device_fraction * fixed_tokens) + running
        self.disk_dir = tempfile.mkdtemp(prefix="kvrelay-bench-kvflow-")
        tiers = _tiers(policy, lower, self.disk_dir, 2 * (fixed_tokens + running) * bytes_per_token)
        config = EngineConfig(kv_cache_bytes=device_tokens * bytes_per_token, block_size=BLOCK_SIZE,
                              reuse=ReuseConfig(enabled=False), tiers=tiers)
        self.engine = LLMEngine(model_dir, config)
        self.work = WorkflowSet(load, model_cfg.vocab_size)
        self.run = PolicyRun(0.0, [], 0.0, 0, 0)

    def warm_up(self) -> None:
        self.work.run(self.engine, 1)

    def timed_cycle(self, cycle: int) -> None:
        stats = self.engine.tiers.stats if self.engine.tiers else None
        before = dataclasses.replace(stats) if stats else None
        seconds, requests, due_checks = self.work.run(self.engine, 1, first_cycle=cycle)
        self.run.seconds += seconds
        self.run.requests += requests
        self.run.due_checks += due_checks
        if stats is not None and before is not None:
            self.run.fetch_seconds += stats.fetch_seconds - before.fetch_seconds
            self.run.num_fetched_blocks += stats.num_fetched - before.num_fetched
            self.run.num_prefetched_blocks += stats.num_prefetched - before.num_prefetched

    def close(self) -> None:
        self.engine.close()
        shutil.rmtree(self.disk_dir, ignore_errors=True)


def _measure(model_dir: Path, load: Workload) -> dict[str, PolicyRun]:
    """Every policy of the workload (keys: lru_recompute, lru_reactive_<tier>, kvflow_<tier>)."""
    benches = {"lru_recompute": PolicyBench(model_dir, load, "lru_recompute", "none")}
    for lower in load.lower_tiers:
        benches[f"lru_reactive_{lower}"] = PolicyBench(model_dir, load, "lru_reactive", lower)
        benches[f"kvflow_{lower}"] = PolicyBench(model_dir, load, "kvflow", lower)
    try:
        for bench in benches.values():
            bench.warm_up()
        for cycle in range(1, load.num_cycles + 1):
            for bench in benches.values():
                bench.timed_cycle(cycle)
        return {name: bench.run for name, bench in benches.items()}
    finally:
        for bench in benches.values():
            bench.close()


def run(quick: bool = False, model: str | None = None) -> BenchResult:
    sizes = QUICK if quick else FULL
    model_dir = resolve_model(model)
    rows: list[tuple[str, str, str, str]] = []
    metrics: dict[str, float] = {}
    hit_runs: list[PolicyRun] = []  # separate workflows (each its own app)
    session_runs: list[PolicyRun] = []  # sessions of one app
    for load in sizes.workloads:
        runs = _measure(model_dir, load)
        recompute = runs["lru_recompute"]
        for lower in load.lower_tiers:
            reactive, kvflow = runs[f"lru_reactive_{lower}"], runs[f"kvflow_{lower}"]
            (session_runs if load.sessions else hit_runs).append(kvflow)
            tag = f"{load.label}, {lower}"
            rows.append((f"{tag}: workflow s vs lru_recompute", f"{kvflow.seconds:.2f}", f"{recompute.seconds:.2f}",
                         f"{kvflow.seconds / recompute.seconds:.3f}"))
            rows.append((f"{tag}: workflow s vs lru_reactive", f"{kvflow.seconds:.2f}", f"{reactive.seconds:.2f}",
                         f"{kvflow.seconds / reactive.seconds:.3f}"))
            rows.append((f"{tag}: prefix on device at admission", f"{kvflow.hit_rate:.3f}",
                         f"{reactive.hit_rate:.3f} / {recompute.hit_rate:.3f}", ""))
            rows.append((f"{tag}: outputs equal lru_recompute's", str(kvflow.same_outputs(recompute)),
                         str(reactive.same_outputs(recompute)), ""))
            rows.append((f"{tag}: blocks prefetched / loaded at admission",
                         f"{kvflow.num_prefetched_blocks} / {kvflow.num_fetched_blocks}",
                         f"0 / {reactive.num_fetched_blocks}", ""))
            if load.sessions:
                rows.append((f"{tag}: next agent within load_ahead, checks",
                             f"{sum(kvflow.due_checks)} / {len(kvflow.due_checks)}", "", ""))
            key = ("" if load is sizes.workloads[0] else
                   f"_{load.num_workflows}{'sessions' if load.sessions else 'wf'}")
            if load.sessions:
                metrics[f"next_agent_hit_rate{key}"] = kvflow.hit_rate
            suffix = "" if lower == "disk" else f"_{lower}"
            metrics[f"speedup_vs_lru_reactive{suffix}{key}"] = reactive.seconds / kvflow.seconds
            if lower == load.lower_tiers[0]:
                metrics[f"speedup_vs_lru_recompute{key}"] = recompute.seconds / kvflow.seconds
            if lower == "disk" and load is sizes.workloads[0]:
                num_prefix_blocks = statistics.mean(f.num_fixed // BLOCK_SIZE for f in reactive.requests)
                per_block = reactive.fetch_seconds / max(reactive.num_fetched_blocks, 1)
                load_seconds = per_block * num_prefix_blocks
                metrics["load_to_step_time_ratio"] = load_seconds / kvflow.mean_step_seconds
                rows.append((f"{tag}: load one prefix / one agent step, ms",
                             f"{1000 * load_seconds:.0f} / {1000 * kvflow.mean_step_seconds:.0f}", "", ""))
    if hit_runs:
        metrics["next_agent_hit_rate"] = (sum(r.hit_rate * len(r.requests) for r in hit_runs)
                                          / sum(len(r.requests) for r in hit_runs))
    checks = [check for r in session_runs for check in r.due_checks]
    if checks:  # from the script's ground truth, never the policy's own prediction
        metrics["next_agent_within_load_ahead"] = sum(checks) / len(checks)
    config = {"quick": quick, "model": model_dir.name, "block_size": BLOCK_SIZE,
              "workloads": [dataclasses.asdict(w) for w in sizes.workloads]}
    return BenchResult("kvflow", metrics, config, rows,
                       headers=("measure", "kvflow", "baseline", "kvflow/baseline"))
