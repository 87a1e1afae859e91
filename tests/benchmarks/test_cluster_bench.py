"""`kvrelay bench cluster`'s plumbing on the tiny model: two one-core engines behind the
gateway, every routing policy on the same prompts, real processes. Exact routing never
changes an answer, and every metric the bench promises is written."""

from __future__ import annotations

import json

import pytest

import benchmarks.cluster as bench_cluster
from benchmarks import run_benchmark


@pytest.mark.slow
def test_cluster_bench_routes_the_same_prompts_by_every_policy(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_cluster, "QUICK_RUNS", {"kvcomm_team": 2})
    monkeypatch.setattr(bench_cluster, "QUICK_MAX_TOKENS", 4)
    monkeypatch.setattr(bench_cluster, "REPLAYS", 1)
    out = tmp_path / "cluster.json"

    result = run_benchmark("cluster", quick=True, json_path=out, model=str(llama_dir))

    payload = json.loads(out.read_text())
    assert payload["name"] == "cluster" and payload["metrics"] == result.metrics
    metrics = result.metrics
    assert payload["config"]["levels"] == [2] and payload["config"]["requests"] == 20
    for policy in bench_cluster.POLICIES:
        assert metrics[f"errors_{policy}_2"] == 0, policy
        assert metrics[f"greedy_match_{policy}_2"] == 1.0, policy  # the same prompts, the same answers
    for name in ("hit_rate_ratio_vs_best", "ttft_p50_ratio_vs_best", "ttft_p50_ratio_vs_session"):
        assert metrics[name] == metrics[f"{name}_2"] and metrics[name] > 0
    assert metrics["greedy_match_min"] == 1.0
    assert metrics["hit_rate_cache_aware_2"] > 0  # a session's agents find their earlier turns' blocks
    # The simulator: fitted to the render replay, checked against each policy, then at scale.
    assert payload["config"]["sim_costs"]["prefill_s_per_token"] > 0 and metrics["sim_cost_factor"] > 0
    for replicas in (2, *bench_cluster.SIM_REPLICAS):
        for policy in bench_cluster.POLICIES:
            assert metrics[f"sim_ttft_p50_ms_{policy}_{replicas}"] > 0, (policy, replicas)
            assert 0 <= metrics[f"sim_hit_rate_{policy}_{replicas}"] < 1, (policy, replicas)
    errors = [abs(metrics[f"sim_ttft_p50_ms_{p}_2"] - metrics[f"ttft_p50_ms_{p}_2"]) / metrics[f"ttft_p50_ms_{p}_2"]
              for p in bench_cluster.POLICIES]
    assert metrics["sim_vs_real_error"] == pytest.approx(max(errors))
    assert metrics["sim_ttft_p50_ratio_vs_least_loaded_64"] == pytest.approx(
        metrics["sim_ttft_p50_ms_least_loaded_64"] / metrics["sim_ttft_p50_ms_cache_aware_64"])
