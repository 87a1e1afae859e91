"""`kvrelay bench icarus`: many task-specialised adapters on SmolLM2, one shared KV cache
(ICaRus) against one cache per adapter (multi-LoRA, vLLM's way).

The workload is ReAct with a Reflexion round. A session has a task (its fixed prompt);
each of its `num_turns` turns goes round-robin to the next of N adapters, whose prompt
is the whole history so far (task, earlier actions, observations), writes a short
action, and gets an observation appended. After the last turn every adapter reflects on
the final transcript at once. Sessions arrive as a Poisson process.

Each mode runs on its own engine with all adapters loaded:
- multi_lora: K/V from base + adapter, the prefix cache namespaced by adapter, so an
  agent reuses only its own earlier turns and the N adapters need N copies of the history;
- icarus: K/V from the base alone, every adapter's turn reuses the whole history.

Measured:
- KV bytes: the prefix cache's blocks after one session alone on an engine with room
  for everything (nothing evicted); icarus / multi_lora is `kv_bytes_ratio_N`.
- Under load: the device KV budget holds every session's history once (with room for
  the largest N's reflections), which the baseline (N copies) overflows. Arrival rates are multiples of the baseline's
  one-session rate (1 / its time for a session alone). Latency is per request, from
  submission to its last token; throughput is requests over the run's wall time. The
  headline ratios are taken at the rate where the baseline's throughput peaks.
Both modes run the same prompts: lengths are fixed (ignore_eos), so the work is the same.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import BenchResult
from engine_ext.adapters.training import LoraFactors
from engine_ext.config import AdapterSpec, EngineConfig, ModelConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.model import load_model
from engine_ext.model_store import resolve_model
from engine_ext.sampling import SamplingParams
from engine_ext.sequence import Sequence
from engine_ext.request import EngineRequest

BLOCK_SIZE = 16
MODES = ("icarus", "multi_lora")
_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Workload:
    adapter_counts: tuple[int, ...]
    num_turns: int
    task_tokens: int  # the session's fixed prompt
    observation_tokens: int  # appended after every action
    output_tokens: int  # each action and each reflection
    reflect_tokens: int  # the Reflexion instruction appended for the final round
    num_sessions: int  # per arrival rate
    rate_factors: tuple[float, ...]  # x the baseline's one-session rate


QUICK = Workload((8,), 4, 96, 16, 4, 8, 2, (2.0,))
FULL = Workload((2, 4, 8), 8, 256, 64, 8, 16, 4, (0.5, 1.0, 2.0, 4.0))


@dataclass
class RunResult:
    seconds: float  # first arrival to last token
    latencies: list[float]  # per request
    num_uncached_tokens: int  # prompt tokens not served from the cache when first admitted
    num_preemptions: int  # requests pushed out for lack of KV memory (recomputed later)

    @property
    def p95(self) -> float:
        return statistics.quantiles(self.latencies, n=20)[-1] if len(self.latencies) > 1 else self.latencies[0]

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds


class Session:
    """One ReAct session's state: its history and what it waits for."""

    def __init__(self, index: int, load: Workload, num_adapters: int, vocab: tuple[int, int], seed: str) -> None:
        self.index, self.load, self.num_adapters = index, load, num_adapters
        self.rng = random.Random(f"{seed}/{index}")
        self.vocab = vocab
        self.history = self._tokens(load.task_tokens)
        self.turn = 0  # turns done; num_turns: the reflection round is out
        self.num_waiting = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randint(*self.vocab) for _ in range(n)]

    def requests(self) -> list[tuple[str, list[int]]]:
        """The next requests as (adapter index, prompt): one turn, or the reflection round."""
        if self.turn < self.load.num_turns:
            return [(str(self.turn % self.num_adapters), list(self.history))]
        prompt = self.history + self._tokens(self.load.reflect_tokens)
        return [(str(a), prompt) for a in range(self.num_adapters)]

    def finished_one(self, output: list[int]) -> bool:
        """Take a finished request's output; True when the session's next requests are due
        (after every turn; a reflection ends the session with its round)."""
        self.num_waiting -= 1
        if self.turn == self.load.num_turns:
            return False
        self.history += output + self._tokens(self.load.observation_tokens)
        self.turn += 1
        return True


def drive(engine: LLMEngine, load: Workload, num_adapters: int, arrivals: list[float], seed: str) -> RunResult:
    """Run the sessions arriving at `arrivals` (seconds from start) to completion."""
    vocab = (min(1000, engine.model_config.vocab_size // 2), engine.model_config.vocab_size - 1)
    sampling = SamplingParams(max_tokens=load.output_tokens, temperature=0.0, ignore_eos=True)
    sessions = [Session(i, load, num_adapters, vocab, seed) for i in range(len(arrivals))]
    running: dict[str, tuple[Session, Sequence, float]] = {}
    latencies: list[float] = []
    uncached = preemptions = 0
    next_session = 0

    def submit(session: Session) -> None:
        for k, (adapter, prompt) in enumerate(session.requests()):
            request_id = f"s{session.index}-t{session.turn}-{k}"
            seq = engine.add_request(EngineRequest(request_id, prompt, sampling, adapter=adapter))
            running[request_id] = (session, seq, time.perf_counter())
            session.num_waiting += 1

    start = time.perf_counter()
    while next_session < len(sessions) or running:
        now = time.perf_counter() - start
        while next_session < len(sessions) and arrivals[next_session] <= now:
            submit(sessions[next_session])
            next_session += 1
        if not engine.has_work:
            time.sleep(min(0.01, max(arrivals[next_session] - now, 0.0)))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            session, seq, submitted = running.pop(out.request_id)
            latencies.append(time.perf_counter() - submitted)
            uncached += out.num_prompt_tokens - out.num_cached_tokens
            preemptions += seq.num_preemptions
            if session.finished_one(seq.output_token_ids):
                submit(session)
    return RunResult(time.perf_counter() - start, latencies, uncached, preemptions)


def write_adapters(model_dir: Path, out: Path, num_adapters: int) -> list[Path]:
    """Random PEFT LoRA adapters on every projection (rank 8): an adapter's weights do not
    change the work, only which K/V it may share. They stand in for `kvrelay train icarus`
    adapters and are marked so (icarus mode refuses unmarked ones); multi_lora serves
    any adapter, so both modes run the same files."""
    model = load_model(model_dir, ModelConfig.from_dir(model_dir))
    paths = []
    for i in range(num_adapters):
        factors = LoraFactors(model, rank=8, alpha=16.0, modules=_MODULES, seed=i, trained_as="icarus")
        gen = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            for b in factors.b.values():
                b.copy_(0.01 * torch.randn(b.shape, generator=gen))
        factors.save(out / str(i))
        paths.append(out / str(i))
    return paths


def session_tokens(load: Workload, num_adapters: int) -> int:
    """The KV one session needs with every agent sharing it: its final transcript and
    the reflections."""
    history = load.task_tokens + load.num_turns * (load.output_tokens + load.observation_tokens)
    return history + load.reflect_tokens + num_adapters * (load.output_tokens + BLOCK_SIZE)


def make_engine(model_dir: Path, adapters: list[Path], mode: str, num_tokens: int) -> LLMEngine:
    cfg = ModelConfig.from_dir(model_dir)
    bytes_per_token = cfg.kv_bytes_per_token(4)  # fp32
    specs = tuple(AdapterSpec(str(i), str(path), mode) for i, path in enumerate(adapters))
    config = EngineConfig(kv_cache_bytes=num_tokens * bytes_per_token, block_size=BLOCK_SIZE,
                          reuse=ReuseConfig(enabled=False), adapters=specs)
    return LLMEngine(model_dir, config)


def arrivals(num_sessions: int, rate: float, seed: str) -> list[float]:
    """Poisson arrivals (seconds from the start), the first at 0."""
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(num_sessions - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


@dataclass
class CountResult:
    """One adapter count, both modes."""

    num_adapters: int
    kv_bytes: dict[str, int]  # mode -> prefix cache bytes after one session alone
    alone: dict[str, RunResult]  # mode -> one session alone
    rates: list[float]  # sessions per second
    loaded: dict[str, list[RunResult]]  # mode -> one result per rate

    @property
    def peak(self) -> int:
        """The rate index where the baseline's throughput peaks."""
        tput = [r.throughput for r in self.loaded["multi_lora"]]
        return tput.index(max(tput))


def measure_count(ample: dict[str, LLMEngine], tight: dict[str, LLMEngine], load: Workload,
                  num_adapters: int) -> CountResult:
    kv_bytes, alone = {}, {}
    for mode in MODES:
        engine = ample[mode]
        engine.kv.pool.reset_cache()
        alone[mode] = drive(engine, load, num_adapters, [0.0], seed=f"alone{num_adapters}")
        kv_bytes[mode] = engine.kv.pool.num_cached * engine.kv_cache.bytes_per_block
    base_rate = 1.0 / alone["multi_lora"].seconds
    rates = [f * base_rate for f in load.rate_factors]
    loaded: dict[str, list[RunResult]] = {mode: [] for mode in MODES}
    for i, rate in enumerate(rates):
        times = arrivals(load.num_sessions, rate, seed=f"rate{num_adapters}/{i}")
        for mode in MODES:  # the same sessions, arriving at the same times
            tight[mode].kv.pool.reset_cache()
            loaded[mode].append(drive(tight[mode], load, num_adapters, times, seed=f"load{num_adapters}/{i}"))
            print(f"icarus bench: N={num_adapters}, {rate * 60:.1f} sessions/min, {mode}: "
                  f"{loaded[mode][-1].seconds:.1f} s", file=sys.stderr, flush=True)
    return CountResult(num_adapters, kv_bytes, alone, rates, loaded)


def run(quick: bool = False, model: str | None = None) -> BenchResult:
    load = QUICK if quick else FULL
    model_dir = resolve_model(model)
    most = max(load.adapter_counts)
    work_dir = Path(tempfile.mkdtemp(prefix="kvrelay-bench-icarus-"))
    try:
        adapters = write_adapters(model_dir, work_dir, most)
        per_session = session_tokens(load, most)
        budget = load.num_sessions * per_session  # every session's history once
        ample = {mode: make_engine(model_dir, adapters, mode, 2 * most * per_session) for mode in MODES}
        tight = {mode: make_engine(model_dir, adapters, mode, budget) for mode in MODES}
        for engine in (*ample.values(), *tight.values()):  # warm up: first-call costs off the clock
            engine.generate(list(range(10, 50)), SamplingParams(max_tokens=2, temperature=0.0), adapter="0")
        results = [measure_count(ample, tight, load, n) for n in load.adapter_counts]
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    rows, metrics = _report(results)
    config = {"quick": quick, "model": model_dir.name, "block_size": BLOCK_SIZE, "dtype": "float32",
              "kv_budget_tokens": budget, "workload": dataclasses.asdict(load)}
    return BenchResult("icarus", metrics, config, rows, headers=("measure", "icarus", "multi_lora", "icarus/multi_lora"))


def _report(results: list[CountResult]) -> tuple[list[tuple[str, str, str, str]], dict[str, float]]:
    rows: list[tuple[str, str, str, str]] = []
    metrics: dict[str, float] = {}
    for res in results:
        n = res.num_adapters
        ours, theirs = res.kv_bytes["icarus"], res.kv_bytes["multi_lora"]
        rows.append((f"N={n}: KV MB of one session", f"{ours / 2**20:.1f}", f"{theirs / 2**20:.1f}",
                     f"{ours / theirs:.3f}"))
        a, b = res.alone["icarus"], res.alone["multi_lora"]
        rows.append((f"N={n}: one session alone, s", f"{a.seconds:.2f}", f"{b.seconds:.2f}",
                     f"{a.seconds / b.seconds:.3f}"))
        for i, rate in enumerate(res.rates):
            a, b = res.loaded["icarus"][i], res.loaded["multi_lora"][i]
            tag = f"N={n}, {rate * 60:.1f} sessions/min" + (" (baseline peak)" if i == res.peak else "")
            rows.append((f"{tag}: p95 latency s", f"{a.p95:.2f}", f"{b.p95:.2f}", f"{a.p95 / b.p95:.3f}"))
            rows.append((f"{tag}: requests/s", f"{a.throughput:.3f}", f"{b.throughput:.3f}",
                         f"{a.throughput / b.throughput:.3f}"))
            rows.append((f"{tag}: prompt tokens not cached at admission", str(a.num_uncached_tokens),
                         str(b.num_uncached_tokens), f"{a.num_uncached_tokens / b.num_uncached_tokens:.3f}"))
            rows.append((f"{tag}: preemptions", str(a.num_preemptions), str(b.num_preemptions), ""))
        peak_a, peak_b = res.loaded["icarus"][res.peak], res.loaded["multi_lora"][res.peak]
        metrics[f"kv_bytes_ratio_{n}"] = ours / theirs
        metrics[f"p95_latency_speedup_{n}"] = peak_b.p95 / peak_a.p95
        metrics[f"throughput_ratio_{n}"] = peak_a.throughput / peak_b.throughput
    return rows, metrics
