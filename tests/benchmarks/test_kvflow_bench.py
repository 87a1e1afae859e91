"""The kvflow benchmark's plumbing on the tiny model: policies side by side, identical outputs, JSON."""

from __future__ import annotations

import json

import benchmarks.kvflow as bench_kvflow
from benchmarks import run_benchmark


def test_kvflow_bench_reports_every_metric(llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_kvflow, "QUICK", bench_kvflow.Sizes(workloads=(
        bench_kvflow.Workload("1 workflow", 1, 4, (48, 96), 8, 2, 1, ("host", "disk")),
        bench_kvflow.Workload("2 workflows", 2, 3, (32, 64), 8, 2, 1, ("disk",)),
        bench_kvflow.Workload("3 sessions", 3, 6, (32, 48), 8, 2, 2, ("host",), sessions=True),
    )))
    out = tmp_path / "kvflow.json"

    result = run_benchmark("kvflow", quick=True, json_path=out, model=str(llama_dir))

    payload = json.loads(out.read_text())
    assert payload["name"] == "kvflow" and payload["metrics"] == result.metrics
    metrics = payload["metrics"]
    for name in ("speedup_vs_lru_recompute", "speedup_vs_lru_reactive", "speedup_vs_lru_reactive_host",
                 "speedup_vs_lru_recompute_2wf", "speedup_vs_lru_reactive_2wf", "load_to_step_time_ratio"):
        assert metrics[name] > 0, name
    assert metrics["next_agent_hit_rate"] == 1.0  # every prefix was on the device when its agent ran
    # 3 sessions of one app, out of phase: each one's next agent (from the script) was due
    assert metrics["next_agent_within_load_ahead"] >= 0.95
    assert "next_agent_hit_rate_3sessions" in metrics and "speedup_vs_lru_recompute_3sessions" in metrics
    checks = next(row for row in result.rows if "within load_ahead" in row[0])
    assert checks[1] == "108 / 108"  # 2 timed cycles x 18 requests x 3 sessions
    equal = [row for row in result.rows if "outputs equal" in row[0]]
    assert len(equal) == 4 and all(row[1:3] == ("True", "True") for row in equal)
    assert "1 workflow, host: workflow s vs lru_reactive" in capsys.readouterr().out
