"""Faithful by default, through the product path: `kvrelay up` with every default and
`kvrelay engine` alone, real processes, SmolLM2, a multi-agent app through the openai
client with no kvrelay headers. Every greedy answer through the gateway must be the
engine alone's, and the gateway's stack must compute no more prompt tokens."""

from __future__ import annotations

import json

import pytest

from benchmarks import run_benchmark


@pytest.mark.slow
def test_defaults_answer_as_the_engine_alone_and_compute_no_more(smollm2_dir, tmp_path):
    out = tmp_path / "faithful.json"
    result = run_benchmark("faithful", quick=True, json_path=out, model=str(smollm2_dir))
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics == result.metrics
    assert metrics["answers"] >= 18  # two passes of the app: cold caches, then warm
    assert metrics["greedy_match"] == 1.0
    assert metrics["computed_tokens_gateway"] <= metrics["computed_tokens_engine"]
    assert metrics["computed_tokens_engine"] > 0
