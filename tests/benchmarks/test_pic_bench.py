"""The pic benchmark's plumbing on the tiny model: every method's TTFT and fidelity, JSON."""

from __future__ import annotations

import json
import math

import pytest

import benchmarks.pic as bench_pic
from benchmarks import run_benchmark


@pytest.mark.slow
def test_pic_bench_reports_ttft_and_fidelity_for_every_method(llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_pic, "QUICK", bench_pic.Sizes(doc_lens=(24,), ttft_repeats=1, num_questions=1,
                                                            num_fidelity_tokens=4))
    out = tmp_path / "pic.json"

    result = run_benchmark("pic", quick=True, json_path=out, model=str(llama_dir))

    payload = json.loads(out.read_text())
    assert payload["name"] == "pic" and payload["metrics"] == result.metrics
    metrics = payload["metrics"]
    for method in ("prefix", "shift", "blend", "link"):
        assert math.isfinite(metrics[f"ttft_reduction_{method}_10x24"])
        assert 0.0 <= metrics[f"top1_agreement_{method}"] <= 1.0 and metrics[f"kl_{method}"] >= 0.0
    assert metrics["top1_agreement_prefix"] == 1.0 and metrics["kl_prefix"] < 1e-4  # exact
    # Each document's KV was computed alone: placed behind the others it must drift past the
    # exact bar, and recomputing the tokens that deviate most must bring blend closer than
    # the shift alone (a blend that recomputed nothing would equal it).
    assert metrics["kl_shift"] > 1e-4 and metrics["kl_link"] > 1e-4
    assert metrics["kl_blend"] < metrics["kl_shift"]
    assert "TTFT ms shift, 10 x 24 tokens" in capsys.readouterr().out
