"""The engine benchmark's plumbing on a tiny model: it runs, reports every metric, writes
JSON; without a vLLM venv the vLLM rows say they were skipped, and with vLLM's numbers
the speedups are kvrelay's over vLLM's. (tests/gateway/vllm runs the probe on real vLLM.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

import benchmarks.engine as bench_engine
import benchmarks.engine_vllm as engine_vllm
from benchmarks import run_benchmark
from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine

SMALL = bench_engine.Sizes(prefill_lens=(48, 96), decode_prompt_len=16, decode_tokens=6, prefix_prompt_len=160,
                           repeats=1)


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(bench_engine, "QUICK", SMALL)
    monkeypatch.setattr(bench_engine, "read_bandwidth", lambda: 20e9)  # a 1 GiB sum is the bench's, not the test's


@pytest.mark.slow
def test_engine_bench_writes_the_issue_metrics(llama_dir, tmp_path, monkeypatch, capsys, small):
    monkeypatch.setattr(engine_vllm, "find_vllm_python", lambda: None)
    out = tmp_path / "engine.json"

    result = run_benchmark("engine", quick=True, json_path=out, model=str(llama_dir))

    payload = json.loads(out.read_text())
    assert payload["name"] == "engine"
    assert set(payload) == {"name", "metrics", "config", "machine"}
    for key in ("prefill_speedup_vs_hf", "decode_speedup_vs_hf", "batch8_decode_throughput_ratio",
                "prefix_hit_ttft_ratio", "decode_roofline_fraction_b1", "weight_bytes_per_token"):
        value = payload["metrics"][key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, key
    m = payload["metrics"]
    assert m["decode_roofline_fraction_b1"] == pytest.approx(m["decode_tps_b1"] * m["weight_bytes_per_token"] / 20e9)
    # the engine's TTFT pricing ran inside its steps, and was timed as a part of them
    assert 0 < m["ttft_pricing_share_of_step"] < 1 and m["ttft_pricing_us_per_step"] > 0
    assert not any("vllm" in key for key in m)
    assert payload["config"]["vllm"].startswith("skipped: no vLLM venv")
    assert payload["metrics"] == result.metrics
    assert payload["config"]["sizes"]["prefill_lens"] == [48, 96]
    assert payload["machine"]["cpu_count"] >= 1
    printed = capsys.readouterr().out
    assert "prefill tok/s @ 96" in printed and "prefix_hit_ttft_ratio" in printed and "skipped" in printed


@pytest.mark.slow
def test_the_vllm_speedups_are_kvrelay_s_over_vllm_s(llama_dir, monkeypatch, small):
    seen = {}

    def fake_engine(model_dir, prefill, decode, decode_tokens, warm, max_model_len, decode_repeats):
        seen.update(prefill={n: len(p[0]) for n, p in prefill.items()}, decode={b: len(p) for b, p in decode.items()},
                    decode_repeats=decode_repeats)
        return engine_vllm.VllmEngine({48: 48 / 1e6, 96: 96 / 1e6}, {1: 1e-6, 8: 2e-6}, 1.0, "0.32.0")

    monkeypatch.setattr(bench_engine, "vllm_engine", fake_engine)  # 1M tok/s prefill, a token per 1M s decode
    apps = []

    def fake_app(model_dir, log_dir, app):
        apps.append(app)
        return {"vllm_apc": 30.0, "kvrelay": 20.0} if len(apps) == 1 else {"vllm_apc": 10.0, "kvrelay": 8.0}

    monkeypatch.setattr(bench_engine, "app_seconds", fake_app)
    m = run_benchmark("engine", quick=True, json_path=None, model=str(llama_dir)).metrics
    assert seen == {"prefill": {48: 48, 96: 96}, "decode": {1: 1, 8: 8}, "decode_repeats": SMALL.repeats}  # as kvrelay's
    assert m["prefill_speedup_vs_vllm"] == pytest.approx(min(m["prefill_tps_48"], m["prefill_tps_96"]) / 1e6)
    assert m["decode_speedup_vs_vllm_b1"] == pytest.approx(m["decode_tps_b1"] / 1e-6)
    assert m["decode_speedup_vs_vllm_b8"] == pytest.approx(m["decode_tps_b8"] / 2e-6)
    assert m["app_speedup_vs_vllm"] == pytest.approx(1.5)
    assert m["app_long_speedup_vs_vllm"] == pytest.approx(1.25)
    short, long = apps
    assert short.max_tokens == engine_vllm.APP_MAX_TOKENS and long.max_tokens is None  # long: answers as captured
    assert {r.workload for r in long.runs} == {"board_openai"} and len(long.runs) == 1  # quick: one task


def test_weight_bytes_count_a_tied_embedding_once_and_an_untied_one_not_at_all(llama_dir):
    engine = LLMEngine(llama_dir, EngineConfig(kv_cache_bytes=2**20))
    model = engine.model

    def every() -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())  # a shared tensor once

    table = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    model.lm_head.weight = model.embed_tokens.weight  # tied: the lm_head reads the table whole
    assert bench_engine.weight_bytes_per_token(engine) == every()
    model.lm_head.weight = torch.nn.Parameter(model.embed_tokens.weight.detach().clone())
    assert bench_engine.weight_bytes_per_token(engine) == every() - table  # untied: the step reads one row


def test_weight_bytes_count_the_quantized_blocks_a_step_reads(llama_dir):
    """int4: each quantized layer counts its blocks and scales, not its dense fp32 copy;
    a tied embedding whose lm_head reads Q8_0 blocks counts one row, not the table."""
    from engine_ext.kernels.compiled import kernels
    from engine_ext.model.linear import PackedLinear

    if kernels() is None:
        pytest.skip("no compiled kernel on this CPU")
    engine = LLMEngine(llama_dir, EngineConfig(kv_cache_bytes=2**20, linear_kernel="int4"))
    model = engine.model
    quantized = [m for m in model.modules() if isinstance(m, PackedLinear) and m.quant is not None]
    assert quantized
    dense = {id(m.weight) for m in quantized} | {id(model.embed_tokens.weight)}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in dense)
    expected = sum(m.quant.nbytes for m in quantized) + rest
    assert bench_engine.weight_bytes_per_token(engine) == expected
    assert expected < sum(p.numel() * p.element_size() for p in model.parameters()) / 2
