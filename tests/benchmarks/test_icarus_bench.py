"""The icarus benchmark's plumbing on the tiny model: both modes run the same sessions,
ICaRus holds one copy of the history where multi-LoRA holds one per adapter, JSON."""

from __future__ import annotations

import json

import benchmarks.icarus as bench_icarus
from benchmarks import run_benchmark


def test_icarus_bench_reports_every_metric(llama_dir, tmp_path, monkeypatch, capsys):
    load = bench_icarus.Workload((2, 4), 4, 64, 16, 3, 8, 2, (1.0, 4.0))
    monkeypatch.setattr(bench_icarus, "QUICK", load)
    out = tmp_path / "icarus.json"

    result = run_benchmark("icarus", quick=True, json_path=out, model=str(llama_dir))

    payload = json.loads(out.read_text())
    assert payload["name"] == "icarus" and payload["metrics"] == result.metrics
    metrics = payload["metrics"]
    for n in (2, 4):
        # One copy of the history against n; the reflections' partial blocks are never cached.
        assert 0 < metrics[f"kv_bytes_ratio_{n}"] <= 1 / n + 0.05
        assert metrics[f"p95_latency_speedup_{n}"] > 0 and metrics[f"throughput_ratio_{n}"] > 0
    computed = [row for row in result.rows if "prompt tokens not cached" in row[0]]
    assert len(computed) == 4 and all(int(row[1]) < int(row[2]) for row in computed)
    assert "N=4: KV MB of one session" in capsys.readouterr().out


def test_a_session_is_react_turns_then_one_reflection_per_adapter():
    load = bench_icarus.Workload((3,), 4, 10, 5, 2, 3, 1, (1.0,))
    session = bench_icarus.Session(0, load, 3, (100, 200), seed="s")
    adapters = []
    for turn in range(4):
        (request,) = session.requests()
        adapters.append(request[0])
        assert len(request[1]) == 10 + turn * (2 + 5)  # the task, then each action and observation
        session.num_waiting = 1
        assert session.finished_one([7, 7])
    assert adapters == ["0", "1", "2", "0"]
    reflections = session.requests()
    assert [a for a, _ in reflections] == ["0", "1", "2"]
    assert all(prompt == reflections[0][1] and len(prompt) == 10 + 4 * 7 + 3 for _, prompt in reflections)
    session.num_waiting = 3
    assert not any(session.finished_one([1, 1]) for _ in range(3))
