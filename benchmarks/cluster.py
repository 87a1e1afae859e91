"""`kvrelay bench cluster`: routing across engine replicas, on the product path.

Two embedded engines, one core each (`taskset`, one thread), behind one gateway; only
the gateway's routing policy changes between stacks (`routing.policy`):
`round_robin`, `least_loaded` (LiteLLM's least-busy), `prefix_hash` (vllm-router's and
SGLang's consistent hashing of the prompt head), `session` (session affinity, the
gateway's default) and `cache_aware` (kvrelay's: the replicas' reported blocks against
their load, kvrelay/gateway/routing/policies.py). Every stack starts cold, with the engines'
defaults and a KV budget per replica that holds a quarter of the level's working set
(the cluster holds half), so which replica holds what decides what is recomputed.

The captured agent traffic (tests/data/agents, the short family: several sessions of
each app, whose agents share their app's fixed prompts) is replayed with N sessions at
once (8 and 32, all 36 sessions; the quick run: 8 sessions of four apps), answers cut to
16 tokens. Prompts are
rendered once by a live warm-up replay and then sent as they are to every stack, so
every policy serves the same prompts and greedy answers can be compared. In the quick
run each policy is replayed twice, the second time in the reverse order of policies,
and its two replays are pooled; the full run replays each once (283 requests).

Metrics: per policy the share of prompt tokens served from cache (`hit_rate_*`) and the
TTFT p50; `hit_rate_ratio_vs_best` (kvrelay / the best baseline's) and
`ttft_p50_ratio_vs_best` (the best baseline's / kvrelay's: above 1, kvrelay is faster),
at the largest level run; `greedy_match_min`: every policy's answers against the first.

`--family long` replays the long captures instead (tests/data/agents/long: boards whose
agents read a shared passage and each other's answers), every request opted into KVCOMM
by a gateway rule, where cache_aware weighs the texts a request would place where their
KV was computed. Each replica holds half the working set (a quarter holds about one
board's prompt), answers are cut to 32 tokens, each policy replays live (an approximate
answer can differ, and the app quotes what it got); the simulator reads the texts each
request would place from the plans the render replay's gateway recorded.

Then the simulator (benchmarks/cluster_sim.py), with step costs measured here on one
thread: the same sessions on 2 simulated replicas, against the measured TTFT p50 of each
policy (`sim_vs_real_error`: the largest relative error over the policies), and on 8, 16
and 64 replicas with as many sessions per replica as the real run had
(`sim_ttft_p50_ratio_vs_least_loaded_64`: least-loaded's simulated TTFT p50 over kvrelay's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path
from typing import Any

from benchmarks.agents.bench import Budget, Cell, Prompts, interleaved, quick_subset, working_set
from benchmarks.agents.long import LONG_CAPTURES
from benchmarks.agents.replay import Outcome, Replay
from benchmarks.agents.stacks import MODEL, warm
from benchmarks.agents.workload import CAPTURES, load_all
from benchmarks.cluster_sim import (BLOCK_SIZE, Costs, PlacedOf, SimResult, SimSession, SimText, Simulation,
                                    build_trace, calibrate, copies)
from benchmarks.common import BenchResult
from benchmarks.stack import Service, kv_bytes_per_token
from engine_ext.model_store import resolve_model
from engine_ext.tokenizer import Tokenizer
from kvrelay.gateway.routing.segment_map import places
from kvrelay.wire.plan import SegmentPlan

FAMILIES = ("short", "long")  # `kvrelay bench cluster --family NAME`; short is the default
POLICIES = ("cache_aware", "session", "round_robin", "least_loaded", "prefix_hash")
BASELINES = ("round_robin", "least_loaded", "prefix_hash")  # what users run instead
KVRELAY = "cache_aware"
QUICK_RUNS = {"kvcomm_team": 2, "village_sep": 2, "autogen_roundrobin": 2, "langgraph_pipeline": 2}
QUICK_MAX_TOKENS = 16
# Answers are cut to this many tokens in the full run too: routing acts on prompts, and two
# one-core replicas decode the captured answers of 36 sessions in hours, not minutes.
FULL_MAX_TOKENS = 16
FULL_LEVELS = (8, 32)
NUM_REPLICAS = 2
REPLAYS = 2  # the quick run's per policy; the second pass runs the policies in reverse order
FULL_REPLAYS = 1  # the full run's: 283 requests per replay
SIM_REPLICAS = (8, 16, 64)
ADMIN_KEY = "bench-cluster-admin-key-0123456789"
RENDER = "least_loaded"  # the policy of the live replay that renders the prompts (and fits the simulator)
# The long family: every request opted into KVCOMM by a gateway rule (the guard at its
# shipped rate), so the texts agents share are placed, not computed, where they are held.
LONG_METHOD = "kvcomm"
LONG_QUICK_RUNS = {"board_autogen": 2, "board_openai": 2}
LONG_LEVELS = (8,)
LONG_MAX_TOKENS = 32  # later agents quote these answers: long enough to be worth placing


class ClusterBench:
    name = "cluster"
    engine = "embedded"
    simulated = True  # the simulator's costs are measured on the embedded engine

    def __init__(self, quick: bool, model: str | None, log_dir: Path, family: str = "short") -> None:
        self.quick = quick
        self.family = family
        self.long = family == "long"
        self.model_dir = resolve_model(model)
        self.log_dir = log_dir
        directory, subset = (LONG_CAPTURES, LONG_QUICK_RUNS) if self.long else (CAPTURES, QUICK_RUNS)
        workloads = load_all(directory, names=list(subset)) if quick else load_all(directory)
        self.runs = interleaved(quick_subset(workloads, subset) if quick else workloads)
        self.levels = (len(self.runs),) if quick else LONG_LEVELS if self.long else FULL_LEVELS
        self.metrics: dict[str, float] = {}
        self.rows: list[tuple[str, str, str, str]] = []
        self._t0 = time.monotonic()
        self._traces: dict[int, tuple[list[SimSession], int, dict[str, Cell], Cell]] = {}  # level -> (trace,
        # KV tokens per replica, the policies' cells, the render replay's)
        self._sim_costs: Costs | None = None

    def run(self) -> BenchResult:
        for level in self.levels:
            self._level(level)
        top = max(self.levels)
        for name in ("hit_rate_ratio_vs_best", "ttft_p50_ratio_vs_best", "ttft_p50_ratio_vs_session"):
            self.metrics[name] = self.metrics[f"{name}_{top}"]
        if self.simulated:
            self._simulate(top)
        if not self.long:  # live replays of an approximate method: answers are not comparable
            self.metrics["greedy_match_min"] = min(v for k, v in self.metrics.items()
                                                   if k.startswith("greedy_match_"))
        config = {"quick": self.quick, "engine": self.engine, "family": self.family, "method": LONG_METHOD if self.long else "exact",
                  "replicas": NUM_REPLICAS, "levels": list(self.levels), "policies": POLICIES,
                  "baselines": BASELINES, "sessions": len(self.runs),
                  "requests": sum(len(r.requests) for r in self.runs),
                  "max_tokens": self._max_tokens(), "replays": REPLAYS if self.quick else FULL_REPLAYS,
                  "model": str(self.model_dir), "sim_replicas": SIM_REPLICAS,
                  "sim_costs": dataclasses.asdict(self._sim_costs) if self._sim_costs else None}
        return BenchResult(self.name, self.metrics, config, self.rows,
                           ("measure", "kvrelay (cache_aware)", "baseline", "ratio (above 1: kvrelay better)"))

    def _level(self, level: int) -> None:
        per_replica = self._kv_tokens(working_set(self.runs, level, {}))
        self._progress(f"{level} sessions at once: {per_replica} KV tokens per replica")
        with self._cluster(RENDER, per_replica) as url:  # the live render, a warm-up
            rendered = self._replay(url, level, None)
        # An approximate answer differs from the exact one now and then, and an app quotes
        # the answers it got: opted in, each policy replays live, quoting its own answers.
        prompts: Prompts | None = None if self.long else {k: (o.body, o.quotes) for k, o in rendered.outcomes.items()}
        cells: dict[str, Cell] = {}
        replays = REPLAYS if self.quick else FULL_REPLAYS
        passes = [POLICIES if i % 2 == 0 else tuple(reversed(POLICIES)) for i in range(replays)]
        for policy in (p for order in passes for p in order):  # mirrored passes: one replay is noisy
            with self._cluster(policy, per_replica) as url:
                c = self._replay(url, level, prompts)
            self._progress(f"{policy}: TTFT p50 {c.ttft_ms(0.5):.0f} ms, hit rate {c.cached_fraction():.3f}, "
                           f"{c.errors} errors")
            cells[policy] = cells[policy].merged(c) if policy in cells else c
        self._score(level, cells)
        self._traces[level] = (self._trace(rendered), per_replica, cells, rendered)

    def _kv_tokens(self, budget: Budget) -> int:
        """Each replica's device KV budget. Short family: a quarter of the working set (the
        engine's default host tier holds twice that). Long family: half, since a quarter
        holds about one board's prompt and leaves KVCOMM nothing to keep."""
        if self.long:
            return budget.full // NUM_REPLICAS
        return max(budget.full // (2 * NUM_REPLICAS), budget.half // NUM_REPLICAS)

    # -- the simulator ---------------------------------------------------------------------
    def _trace(self, rendered: Cell) -> list[SimSession]:
        tokenizer = Tokenizer(self.model_dir)

        def encode(body: dict[str, Any]) -> list[int]:
            return tokenizer.encode(tokenizer.render_chat(body["messages"], tools=body.get("tools")))

        def first_message(body: dict[str, Any]) -> int:
            text = tokenizer.render_chat(body["messages"][:1], tools=body.get("tools"), add_generation_prompt=False)
            return len(tokenizer.encode(text))

        return build_trace(self.runs, rendered.outcomes, encode, first_message,
                           self._placed_of(tokenizer) if self.long else None)

    def _placed_of(self, tokenizer: Tokenizer) -> PlacedOf:
        """The texts each request of the render replay would place, from the plans its
        gateway recorded (the same inference every policy's gateway runs)."""
        with closing(sqlite3.connect(self.log_dir / f"{RENDER}.sqlite")) as db:
            plans = {rid: SegmentPlan.model_validate_json(plan)
                     for rid, plan in db.execute("SELECT id, plan FROM requests WHERE plan IS NOT NULL")}

        def placed(outcome: Outcome, ids_of: dict[str, int]) -> tuple[SimText, ...]:
            plan = plans.get(outcome.request_id or "")
            messages = outcome.body.get("messages") or []
            texts = []
            for segment in plan.segments if plan else ():
                content = messages[segment.message_index].get("content")
                if not places(segment) or not isinstance(content, str):
                    continue
                head = [*messages[:segment.message_index],
                        {**messages[segment.message_index], "content": content[:segment.char_start]}]
                start = len(tokenizer.encode(tokenizer.render_chat(head, tools=outcome.body.get("tools"),
                                                                   add_generation_prompt=False)))
                tokens = len(tokenizer.encode(content[segment.char_start:segment.char_end]))
                texts.append(SimText(segment.content_hash, start, tokens, ids_of.get(segment.source_request or ""),
                                     anchored=segment.kind == "placeholder"))
            return tuple(texts)

        return placed

    def _simulate(self, level: int) -> None:
        """The simulator against this level's measured run (2 replicas), then at scale."""
        trace, per_replica, cells, rendered = self._traces[level]
        measured = calibrate(self.model_dir)
        blocks = per_replica // BLOCK_SIZE
        # One factor for what a real run adds to the engine measured alone, fitted to the
        # render replay: a replay of its own, not one of those the simulator is checked on.
        render = Simulation(measured, NUM_REPLICAS, blocks, RENDER, level).run(trace)
        factor = rendered.ttft_ms(0.5) / render.ttft_p50_ms
        costs = self._sim_costs = measured.scaled(factor)
        self.metrics["sim_cost_factor"] = factor
        self._progress(f"simulator costs (one core, measured x {factor:.2f}): {costs.prefill_s_per_token * 1000:.2f} "
                       f"ms a prompt token, decode step {costs.step_s * 1000:.1f} + "
                       f"{costs.step_s_per_seq * 1000:.1f} ms a sequence")
        errors = []
        for policy in POLICIES:
            sim = Simulation(costs, NUM_REPLICAS, blocks, policy, level).run(trace)
            real = cells[policy].ttft_ms(0.5)
            errors.append(abs(sim.ttft_p50_ms - real) / real)
            self.metrics[f"sim_ttft_p50_ms_{policy}_{NUM_REPLICAS}"] = sim.ttft_p50_ms
            self.metrics[f"sim_hit_rate_{policy}_{NUM_REPLICAS}"] = sim.hit_rate
            self.rows.append((f"simulated vs measured, {NUM_REPLICAS} replicas: TTFT p50 ms, {policy}",
                              f"{sim.ttft_p50_ms:.0f}", f"{real:.0f}", f"{sim.ttft_p50_ms / real:.3f}"))
        self.metrics["sim_vs_real_error"] = max(errors)
        per_replica_sessions = max(level // NUM_REPLICAS, 1)
        for replicas in SIM_REPLICAS:
            sessions = copies(trace, per_replica_sessions * replicas)
            results = {p: Simulation(costs, replicas, blocks, p, len(sessions)).run(sessions) for p in POLICIES}
            self._sim_rows(replicas, len(sessions), results)

    def _sim_rows(self, replicas: int, sessions: int, results: dict[str, SimResult]) -> None:
        ours = results[KVRELAY]
        for policy, result in results.items():
            self.metrics[f"sim_ttft_p50_ms_{policy}_{replicas}"] = result.ttft_p50_ms
            self.metrics[f"sim_hit_rate_{policy}_{replicas}"] = result.hit_rate
        best = min(results[b].ttft_p50_ms for b in BASELINES)
        self.metrics[f"sim_ttft_p50_ratio_vs_least_loaded_{replicas}"] = \
            results["least_loaded"].ttft_p50_ms / ours.ttft_p50_ms
        self.metrics[f"sim_ttft_p50_ratio_vs_best_{replicas}"] = best / ours.ttft_p50_ms
        for policy in POLICIES[1:]:
            result = results[policy]
            self.rows.append((f"simulated, {replicas} replicas, {sessions} sessions: TTFT p50 ms, vs {policy}",
                              f"{ours.ttft_p50_ms:.0f}", f"{result.ttft_p50_ms:.0f}",
                              f"{result.ttft_p50_ms / ours.ttft_p50_ms:.3f}"))
            self.rows.append((f"simulated, {replicas} replicas: prompt share from cache, vs {policy}",
                              f"{ours.hit_rate:.3f}", f"{result.hit_rate:.3f}", ""))

    def _score(self, level: int, cells: dict[str, Cell]) -> None:
        ours = cells[KVRELAY]
        reference = cells[POLICIES[0]]
        for policy, cell in cells.items():
            self.metrics[f"hit_rate_{policy}_{level}"] = cell.cached_fraction()
            self.metrics[f"ttft_p50_ms_{policy}_{level}"] = cell.ttft_ms(0.5)
            self.metrics[f"makespan_s_{policy}_{level}"] = cell.makespan_s(self.runs)
            self.metrics[f"errors_{policy}_{level}"] = float(cell.errors)
            if not self.long:  # live replays of an approximate method: answers are not comparable
                self.metrics[f"greedy_match_{policy}_{level}"] = cell.greedy_match(reference, same_prompt=True)
        best_hit = max(cells[b].cached_fraction() for b in BASELINES)
        best_ttft = min(cells[b].ttft_ms(0.5) for b in BASELINES)
        self.metrics[f"hit_rate_ratio_vs_best_{level}"] = ours.cached_fraction() / best_hit if best_hit else float("inf")
        self.metrics[f"ttft_p50_ratio_vs_best_{level}"] = best_ttft / ours.ttft_ms(0.5)
        self.metrics[f"ttft_p50_ratio_vs_session_{level}"] = cells["session"].ttft_ms(0.5) / ours.ttft_ms(0.5)
        for policy in POLICIES[1:]:
            cell = cells[policy]
            self.rows.append((f"{level} sessions: TTFT p50 ms, vs {policy}", f"{ours.ttft_ms(0.5):.0f}",
                              f"{cell.ttft_ms(0.5):.0f}", f"{cell.ttft_ms(0.5) / ours.ttft_ms(0.5):.3f}"))
            self.rows.append((f"{level} sessions: prompt share from cache, vs {policy}",
                              f"{ours.cached_fraction():.3f}", f"{cell.cached_fraction():.3f}",
                              f"{ours.cached_fraction() / cell.cached_fraction():.3f}" if cell.cached_fraction()
                              else "-"))

    def _replay(self, url: str, level: int, prompts: Prompts | None) -> Cell:
        return Cell(Replay(url, MODEL, self.runs, level, prompts, max_tokens=self._max_tokens()).run())

    def _max_tokens(self) -> int:
        if self.long:
            return LONG_MAX_TOKENS
        return QUICK_MAX_TOKENS if self.quick else FULL_MAX_TOKENS

    @contextmanager
    def _cluster(self, policy: str, kv_tokens: int) -> Iterator[str]:
        """Two engines on a core each and a gateway routing by `policy`; its URL."""
        secret = secrets.token_hex(16)
        with ExitStack() as stack:
            engines = self._engines(stack, policy, kv_tokens, secret)
            args = ["gateway", "--database-url", f"sqlite+aiosqlite:///{self.log_dir / policy}.sqlite",
                    "--log-level", "warning"]
            for engine in engines:
                args += ["--upstream", engine]
            env = self._gateway_env(policy, secret)
            gateway = stack.enter_context(_running(Service(f"{policy}-gateway", args, env, self.log_dir), 120))
            for engine in engines:
                warm(engine)
            yield gateway.url

    def _engines(self, stack: ExitStack, policy: str, kv_tokens: int, secret: str) -> list[str]:
        """Start the replicas, one core each, cold, `kv_tokens` of KV each (stopped with
        `stack`); their URLs."""
        kv_mb = str(max(1, -(-kv_tokens * kv_bytes_per_token(str(self.model_dir)) // 2**20)))
        urls = []
        for core in range(NUM_REPLICAS):
            args = ["engine", "--model", str(self.model_dir), "--served-model-name", MODEL,
                    "--kv-cache-mb", kv_mb, "--max-num-seqs", "64", "--log-level", "warning"]
            env = {"KVRELAY_PLAN_SECRET": secret, "OMP_NUM_THREADS": "1"}
            service = Service(f"{policy}-engine{core}", args, env, self.log_dir,
                              wrapper=("taskset", "-c", str(core % (os.cpu_count() or 1))))
            urls.append(stack.enter_context(_running(service, 300)).url)
        return urls

    def _gateway_env(self, policy: str, secret: str) -> dict[str, str]:
        env = {"KVRELAY_PLAN_SECRET": secret, "KVRELAY_ADMIN_KEY": ADMIN_KEY, "KVRELAY_HEALTH_INTERVAL_S": "0.5",
               "KVRELAY_ROUTING__POLICY": policy, "KVRELAY_ROUTING__CACHE_POLL_INTERVAL_S": "0.5"}
        if self.long:  # what a user who accepts approximation configures
            env["KVRELAY_APPROXIMATION__RULES"] = json.dumps([{"method": LONG_METHOD}])
        return env

    def _progress(self, what: str) -> None:
        print(f"[bench {self.name} +{time.monotonic() - self._t0:.0f}s] {what}", file=sys.stderr, flush=True)


@contextmanager
def _running(service: Service, timeout: float) -> Iterator[Service]:
    try:
        service.start(timeout=timeout)
    except RuntimeError as exc:
        service.stop()
        raise ValueError(f"bench cluster: {exc}") from exc
    try:
        yield service
    finally:
        service.stop()


def run(quick: bool = False, model: str | None = None, family: str = "short") -> BenchResult:
    if family not in FAMILIES:
        raise ValueError(f"bench cluster: no family {family!r}; families: {', '.join(FAMILIES)}")
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-cluster-") as tmp:
        return ClusterBench(quick, model, Path(tmp), family).run()

