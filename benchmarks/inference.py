"""Inference cost on the request path: identify + infer + build and serialise the plan.

A session holds 100 earlier outputs of 5 agents (about 600 characters each); each
measured request is an agent's prompt of 2k, 16k or 64k characters that quotes three of
those outputs amid other text. The baseline for the matcher is the obvious one: look
for every stored output with `str.find` (C speed, but one pass per output).

Then the adversarial run (benchmarks/inference_adversarial.py): 10,000 agents in one
app, a 1,000-node step graph and 64k-character prompts of adversarial text, planned on a
real event loop whose lag is measured meanwhile.
"""

from __future__ import annotations

import random
import statistics
import time
import tracemalloc

from benchmarks.common import BenchResult
from benchmarks.inference_adversarial import GRAPH_NODES, NUM_AGENTS, PROMPT_CHARS, run_adversarial
from kvrelay.wire.plan import attach_plan
from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.settings import InferenceSettings

_WORDS = ("agent", "plan", "step", "result", "value", "check", "the", "of", "and", "to", "code", "test",
          "answer", "because", "therefore", "number", "list", "review", "error", "fix")
_NUM_AGENTS, _NUM_OUTPUTS, _OUTPUT_CHARS = 5, 100, 600


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS) + (str(rng.randint(0, 99)) if rng.random() < 0.2 else "")
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


def _session(inference: Inference, rng: random.Random, session_id: str) -> tuple[list[str], list[str]]:
    """Register the session's outputs; returns (system prompts, outputs)."""
    systems = [f"You are agent {i}. " + _text(rng, 400) for i in range(_NUM_AGENTS)]
    outputs = [_text(rng, _OUTPUT_CHARS) for _ in range(_NUM_OUTPUTS)]
    for n, output in enumerate(outputs):
        agent = f"agent-{n % _NUM_AGENTS}"
        inference.observe_response("bench", session_id, agent, f"req-{session_id}-{n}", output)
    return systems, outputs


def _prompt(rng: random.Random, system: str, outputs: list[str], chars: int) -> dict:
    quoted = rng.sample(outputs, 3)
    filler = max(0, chars - len(system) - sum(len(q) for q in quoted))
    parts = [_text(rng, filler // 4), quoted[0], _text(rng, filler // 4), quoted[1], _text(rng, filler // 4),
             quoted[2], _text(rng, filler - 3 * (filler // 4))]
    return {"model": "bench", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": "\n\n".join(parts)}]}


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def run(quick: bool, model: str | None) -> BenchResult:
    del model  # no model involved
    rng = random.Random(0)
    inference = Inference(InferenceSettings())
    systems, outputs = _session(inference, rng, "s-bench")
    headers = {"x-kvrelay-session-id": "s-bench", "x-kvrelay-app": "bench"}
    num_requests = 60 if quick else 400
    rows, metrics = [], {}
    for chars in (2_000, 16_000, 64_000):
        bodies = [_prompt(rng, systems[i % _NUM_AGENTS], outputs, chars) for i in range(num_requests)]
        infer_ms, naive_ms, found = [], [], 0
        for i, body in enumerate(bodies):
            start = time.perf_counter()
            ident = identify(headers, body)
            result = inference.plan(ident, body, f"req-{chars}-{i}", "bench")
            attach_plan(body, result.plan)
            result.plan.model_dump_json()
            infer_ms.append((time.perf_counter() - start) * 1e3)
            found += sum(s.kind == "placeholder" for s in result.plan.segments)
            content = body["messages"][1]["content"]
            start = time.perf_counter()
            [o for o in outputs if content.find(o) >= 0]
            naive_ms.append((time.perf_counter() - start) * 1e3)
        label = f"{chars // 1000}k"
        p50, p99, naive50 = _pct(infer_ms, 50), _pct(infer_ms, 99), _pct(naive_ms, 50)
        rows.append((f"infer p50 ms @ {label} chars", f"{p50:.3f}", f"{naive50:.3f} (str.find x100)", ""))
        rows.append((f"infer p99 ms @ {label} chars", f"{p99:.3f}", "", ""))
        metrics[f"infer_p50_ms_{label}"], metrics[f"infer_p99_ms_{label}"] = p50, p99
        metrics[f"naive_find_p50_ms_{label}"] = naive50
        metrics[f"placeholders_found_per_request_{label}"] = found / len(bodies)
    metrics["state_bytes_per_session"] = _state_bytes_per_session(8 if quick else 32)
    rows.append(("state bytes per session (100 outputs)", f"{metrics['state_bytes_per_session']:.0f}",
                 f"{_NUM_OUTPUTS * _OUTPUT_CHARS} (the output text alone)", ""))
    adversarial = run_adversarial(quick)
    metrics["infer_p50_ms_adversarial"] = _pct(adversarial.infer_ms, 50)
    metrics["infer_p99_ms_adversarial"] = _pct(adversarial.infer_ms, 99)
    metrics["infer_max_ms_adversarial"] = max(adversarial.infer_ms)
    metrics["loop_lag_p99_ms"] = _pct(adversarial.loop_lag_ms, 99)
    metrics["loop_lag_max_ms"] = max(adversarial.loop_lag_ms)
    metrics["plans_over_budget_adversarial"] = adversarial.bounded.get("plans_over_budget", 0)
    metrics["full_gc_during_adversarial"] = len(adversarial.full_gc_ms)
    metrics["full_gc_max_ms"] = max(adversarial.full_gc_ms, default=0.0)
    rows.append(("infer p50 / p99 ms, adversarial", f"{metrics['infer_p50_ms_adversarial']:.3f} / "
                 f"{metrics['infer_p99_ms_adversarial']:.3f}", "", "target p99 <= 5"))
    rows.append(("event-loop lag p99 / max ms, adversarial", f"{metrics['loop_lag_p99_ms']:.3f} / "
                 f"{metrics['loop_lag_max_ms']:.3f}", "", "target p99 <= 10"))
    rows.append(("plans over budget, adversarial", f"{metrics['plans_over_budget_adversarial']:.0f} of "
                 f"{len(adversarial.infer_ms)}", "", ""))
    rows.append(("full GCs during the run (longest ms)", f"{len(adversarial.full_gc_ms)} "
                 f"({metrics['full_gc_max_ms']:.1f})", "", "not planning: the heap's size"))
    config = {"quick": quick, "requests_per_size": num_requests, "outputs_in_session": _NUM_OUTPUTS,
              "output_chars": _OUTPUT_CHARS, "agents": _NUM_AGENTS, "quoted_outputs_per_prompt": 3,
              "adversarial": {"agents": NUM_AGENTS, "agents_in_memory": adversarial.agents,
                              "graph_nodes": GRAPH_NODES, "graph_edges_at_end": adversarial.graph_edges,
                              "prompt_chars": PROMPT_CHARS, "requests": len(adversarial.infer_ms),
                              "bounded": adversarial.bounded}}
    return BenchResult("inference", metrics, config, rows,
                       headers=("measure", "kvrelay", "baseline matcher", ""))


def _state_bytes_per_session(num_sessions: int) -> float:
    """Memory the inference state holds per session of 100 outputs (tracemalloc)."""
    rng = random.Random(1)
    inference = Inference(InferenceSettings())
    _session(inference, rng, "warm-up")  # agents, numpy power tables: not per session
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(num_sessions):
        _session(inference, rng, f"s-{n}")
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / num_sessions
