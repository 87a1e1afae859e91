"""The kvcomm benchmark's plumbing on the tiny model: per-agent TTFT, reuse, fidelity, JSON."""

from __future__ import annotations

import json

import pytest

import benchmarks.kvcomm as bench_kvcomm
from benchmarks import run_benchmark


@pytest.mark.slow
def test_kvcomm_bench_reports_every_metric(llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_kvcomm, "QUICK", bench_kvcomm.Sizes(
        num_agents=3, num_questions=4, role_tokens=20, question_tokens=40, answer_tokens=24, num_fidelity_tokens=3))
    out = tmp_path / "kvcomm.json"

    result = run_benchmark("kvcomm", quick=True, json_path=out, model=str(llama_dir))

    payload = json.loads(out.read_text())
    assert payload["name"] == "kvcomm" and payload["metrics"] == result.metrics
    metrics = payload["metrics"]
    for k in (1, 2, 3):
        for method in ("dense", "prefix", "kvcomm"):
            assert metrics[f"ttft_ms_{method}_agent{k}"] > 0
    assert 0.0 < metrics["reuse_rate"] <= 1.0  # later questions are predicted from the first ones' anchors
    # Placed from anchors, the answers' KV is approximate: it drifts past the exact bar, and
    # the anchors' offsets bring it closer to dense than the RoPE shift alone.
    assert metrics["top1_agreement"] <= 1.0 and metrics["kl"] > 1e-4
    assert metrics["kl_ratio_vs_shift"] < 1.0
    assert metrics["top1_agreement_exact"] == 1.0 and metrics["kl_exact"] < 1e-4  # the default is exact
    assert metrics["anchors"] >= 1 and metrics["anchor_mib"] > 0
    assert "TTFT ms agent 3" in capsys.readouterr().out
