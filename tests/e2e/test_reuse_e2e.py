"""Agent-to-agent KV reuse end to end with SmolLM2: the official `openai` client ->
gateway (infers the placeholder) -> embedded engine (reuses the answer's KV)."""

from __future__ import annotations

import openai
import pytest

from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine

MODEL = "smollm2"
QUESTION = "Name three colours of the rainbow."

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(smollm2_dir, run_server):
    llm = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=256 * 2**20), model_name=MODEL)
    with run_server(llm, MODEL) as server:
        yield server


def test_the_next_agent_reuses_the_answer_it_reads(srv, start_gateway):
    gw = start_gateway([srv.base_url], approximation={"rules": [{"method": "blend"}]})  # approximate: opted in
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120) as client:
        first = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=64,
            messages=[{"role": "system", "content": "You are the solver. Answer in one short sentence."},
                      {"role": "user", "content": QUESTION}])
        answer = first.choices[0].message.content
        assert first.choices[0].finish_reason == "stop" and len(answer) > 20

        second = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=16,
            messages=[{"role": "system", "content": "You are the critic. Check the solver's answer."},
                      {"role": "user", "content": QUESTION},
                      {"role": "user", "name": "solver", "content": answer}])
    report = second.model_extra["kv_transfer_params"]["kvrelay_reuse"]
    placeholders = [s for s in report["segments"] if s["kind"] == "placeholder" and s["index"] is not None]
    reused = [s for s in placeholders if s["tokens_reused"] > 0]
    assert reused, report
    assert reused[0]["method"] == "blend"
    assert second.usage.prompt_tokens_details.cached_tokens >= reused[0]["tokens_reused"]
