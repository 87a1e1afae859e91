"""`kvrelay bench agents --quick`: captured framework traffic through `kvrelay up` with
its defaults and through prefix caching alone (and vLLM where its venv exists), real
processes, SmolLM2, several sessions at once. The defaults must answer exactly as
prefix caching does and be scored against the capture's labels."""

from __future__ import annotations

import json

import pytest

from benchmarks import run_benchmark


@pytest.mark.slow
def test_quick_agents_bench_replays_captures_through_the_product_path(smollm2_dir, tmp_path):
    out = tmp_path / "agents.json"
    result = run_benchmark("agents", quick=True, json_path=out, model=str(smollm2_dir))
    payload = json.loads(out.read_text())
    assert payload["name"] == "agents" and payload["metrics"] == result.metrics
    metrics = result.metrics
    level = payload["config"]["levels"][0]
    tag = f"c{level}_full"
    assert level >= 4
    assert metrics[f"errors_kvrelay_{tag}"] == 0 and metrics[f"errors_prefix_{tag}"] == 0
    assert metrics[f"greedy_match_default_{tag}"] == 1.0
    # Agents' shared prompts are served from cache, at least as much as prefix caching serves.
    assert metrics[f"cached_fraction_kvrelay_{tag}"] >= metrics[f"cached_fraction_prefix_{tag}"] > 0
    for name in ("placeholder_f1", "session_rand", "agent_rand", "round_acc", "next_agent_acc"):
        assert 0.0 <= metrics[f"{name}_{tag}"] <= 1.0
    assert metrics[f"session_rand_{tag}"] > 0.5
