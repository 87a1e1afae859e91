"""`kvrelay bench inference` reports its metrics in the result JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks import run_benchmark


@pytest.mark.slow
def test_inference_bench_quick_writes_the_issue_metrics(tmp_path):
    out = tmp_path / "inference.json"
    result = run_benchmark("inference", quick=True, json_path=out, model=None)
    data = json.loads(out.read_text())
    assert data["name"] == "inference" and set(data) >= {"metrics", "config", "machine"}
    for name in ("infer_p50_ms_16k", "infer_p99_ms_64k", "state_bytes_per_session", "infer_p99_ms_adversarial",
                 "loop_lag_p99_ms"):
        assert data["metrics"][name] > 0
    adversarial = data["config"]["adversarial"]
    assert adversarial["agents_in_memory"] == adversarial["agents"] == 10_000 and adversarial["graph_nodes"] == 1_000
    # every measured prompt had its three quoted outputs found
    assert all(result.metrics[f"placeholders_found_per_request_{k}"] == 3 for k in ("2k", "16k", "64k"))
