"""The collective benchmark's plumbing on the tiny model: round times, storage, restore, fidelity, JSON."""

from __future__ import annotations

import json
import math

import pytest

import benchmarks.collective as bench_collective
from benchmarks import run_benchmark


@pytest.mark.slow
def test_collective_bench_reports_every_metric(llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_collective, "QUICK", bench_collective.Sizes(
        agent_counts=(3,), history_tokens=24, output_tokens=24, repeats=1, fidelity_agents=2, num_fidelity_tokens=3,
        next_turn_agents=2))
    out = tmp_path / "collective.json"

    result = run_benchmark("collective", quick=True, json_path=out, model=str(llama_dir))

    payload = json.loads(out.read_text())
    assert payload["name"] == "collective" and payload["metrics"] == result.metrics
    metrics = payload["metrics"]
    assert metrics["collective_speedup_3"] > 0 and math.isfinite(metrics["collective_speedup_3"])
    assert 0 < metrics["mirror_fraction"] < 1
    assert metrics["round_storage_reduction_3"] > 1
    assert metrics["restore_bit_exact"] == 1.0
    assert metrics["restore_ms_fused"] > 0 and metrics["restore_ms_dense"] > 0
    assert metrics["next_turn_ttft_ms_restored"] > 0 and metrics["next_turn_speedup"] > 0
    assert metrics["top1_agreement_exact"] == 1.0 and metrics["kl_exact"] < 1e-4  # the default is exact
    # Collective reuse places KV the agents computed under other prefixes: it must drift
    # from dense (a round that fell back to dense prefill would not), yet stay close.
    assert 1e-4 < metrics["kl"] < 1.0 and metrics["top1_agreement"] >= 0.5
    # Per-request blend places too (the bench raises when it does not); its fidelity is
    # bounded, not pinned: on this two-layer model its KL is that of the exact path.
    assert metrics["top1_agreement_per_request"] >= 0.5 and 0 <= metrics["kl_per_request"] < 1.0
    assert "round prefill ms, 3 agents" in capsys.readouterr().out
