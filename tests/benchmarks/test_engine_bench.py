"""The engine benchmark's plumbing on a tiny model: it runs, reports every metric, writes JSON."""

from __future__ import annotations

import json
import math

import benchmarks.engine as bench_engine
from benchmarks import run_benchmark


def test_engine_bench_writes_the_issue_metrics(llama_dir, tmp_path, monkeypatch, capsys):
    small = bench_engine.Sizes(prefill_lens=(48, 96), decode_prompt_len=16, decode_tokens=6,
                               prefix_prompt_len=160, repeats=1)
    monkeypatch.setattr(bench_engine, "QUICK", small)
    out = tmp_path / "engine.json"

    result = run_benchmark("engine", quick=True, json_path=out, model=str(llama_dir))

    payload = json.loads(out.read_text())
    assert payload["name"] == "engine"
    assert set(payload) == {"name", "metrics", "config", "machine"}
    for key in ("prefill_speedup_vs_hf", "decode_speedup_vs_hf",
                "batch8_decode_throughput_ratio", "prefix_hit_ttft_ratio"):
        value = payload["metrics"][key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, key
    assert payload["metrics"] == result.metrics
    assert payload["config"]["sizes"]["prefill_lens"] == [48, 96]
    assert payload["machine"]["cpu_count"] >= 1
    printed = capsys.readouterr().out
    assert "prefill tok/s @ 96" in printed and "prefix_hit_ttft_ratio" in printed
