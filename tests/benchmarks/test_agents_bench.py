"""`kvrelay bench agents --quick`: captured framework traffic through `kvrelay up` with
its defaults and through prefix caching alone (and vLLM where its venv exists), real
processes, SmolLM2, several sessions at once. The defaults must answer exactly as
prefix caching does and be scored against the capture's labels."""

from __future__ import annotations

import json

import pytest

from benchmarks import run_benchmark
from benchmarks.agents.long import workload_guard


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
    # Inference scored against the captures' labels. Floors well under what a quick run
    # scores (placeholder F1 0.815, session and agent Rand 1.0, round 0.795, next agent
    # 0.448 / 0.684 warm) and far over what a broken rule scores (no placeholder, no
    # round, no prediction: 0).
    assert metrics[f"placeholder_f1_{tag}"] >= 0.6 and metrics[f"placeholder_precision_{tag}"] >= 0.6
    assert metrics[f"session_rand_{tag}"] >= 0.95 and metrics[f"agent_rand_{tag}"] >= 0.95
    assert metrics[f"round_acc_{tag}"] >= 0.6
    assert metrics[f"next_agent_acc_{tag}"] >= 0.25 and metrics[f"next_agent_acc_warm_{tag}"] >= 0.45


@pytest.mark.slow
def test_quick_long_family_defaults_are_exact_and_the_warm_task_reuses(smollm2_dir, tmp_path):
    """`kvrelay bench agents --family long --quick`: two board_openai tasks (a warm-up and
    a warm one; 24-token answers), one session at a time, on prefix caching, the defaults
    and the kvcomm opt-in. The kvcomm engine is being reworked, so no speed-up is asserted:
    what must hold is that the defaults answer token for token as prefix caching does,
    that the warm task's prompts are served partly from cache, and that every figure the
    family reports is there."""
    out = tmp_path / "agents-long.json"
    result = run_benchmark("agents", quick=True, json_path=out, model=str(smollm2_dir), family="long")
    payload = json.loads(out.read_text())
    metrics = result.metrics
    assert payload["metrics"] == metrics
    config = payload["config"]
    assert config["family"] == "long" and config["stacks"] == ["prefix", "kvrelay", "kvrelay_kvcomm"]
    assert config["workloads"]["board_openai"]["runs"] == 2
    for stack in (*config["stacks"], "prefix_in_turns"):  # prefix caching again, in turns with the defaults
        assert metrics[f"errors_{stack}"] == 0
        assert all(metrics[f"ttft_mean_ms_agent{i}_{stack}"] > 0 for i in range(1, 6))
    assert metrics["ttft_ratio_default_vs_prefix"] == (metrics["ttft_p50_ms_prefix_in_turns"]
                                                       / metrics["ttft_p50_ms_kvrelay"])
    # Exact reuse: the same answers as prefix caching, on the warm-up task and the warm one.
    assert metrics["greedy_match_default"] == 1.0 and metrics["greedy_match_default_warmup"] == 1.0
    # The warm task's agents find their personas (computed by the warm-up task) in cache.
    assert metrics["reuse_rate_kvcomm"] > 0
    assert metrics["reuse_rate_default"] >= metrics["reuse_rate_prefix"] > 0
    # Long prompts: agent 5 reads the passage, its question and four answers.
    assert metrics["prompt_tokens_agent5_mean"] > 900
    for name in ("agent5_speedup_kvcomm", "ttft_ratio_default_vs_prefix", "greedy_match_kvcomm",
                 "switch_offs_kvcomm", "board_openai_agent5_speedup_kvcomm", "placeholder_f1_board_openai"):
        assert name in metrics and metrics[name] == metrics[name], name  # present, not NaN
    assert {f"{name}_warmup" for name in ("agent5_speedup_kvcomm", "reuse_rate_kvcomm")} <= metrics.keys()
    # kvcomm replays live (its own answers quoted): its greedy match is over the prompts
    # that came out identical to prefix's, agent 1's at least.
    assert metrics["greedy_compared_kvcomm"] >= 1


def test_each_probed_stack_reports_its_guard_figures_per_workload():
    """The pooled KL averages boards whose fidelity differs severalfold; each one's stays visible."""
    guard = {"top1": 0.975, "kl": 0.054, "scores": 20.0, "switch_offs": 0.0}
    assert workload_guard("board_openai", "kvrelay_kvcomm_probed", guard) == {
        "board_openai_top1_kvcomm": 0.975, "board_openai_kl_kvcomm": 0.054, "board_openai_probe_scores_kvcomm": 20.0}
    assert set(workload_guard("village_long", "kvrelay_blend_probed", guard)) == {
        "village_long_top1_blend", "village_long_kl_blend", "village_long_probe_scores_blend"}
    assert workload_guard("board_openai", "kvrelay_kvcomm", guard) == {}  # sampled at the shipped rate: not all
    assert workload_guard("board_openai", "kvrelay_kvcomm_probed", {**guard, "scores": 0.0}) == {}
