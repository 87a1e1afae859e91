"""KVFlow end to end: an unmodified agent loop -> gateway (agents, fixed prefixes, step
graph in the plan) -> embedded engine (workflow-aware eviction and prefetch from the
host tier), with a device tier too small for every agent's prefix."""

from __future__ import annotations

import openai
import pytest

from engine_ext.config import ReuseConfig, TierConfig
from tests.helpers import TINY_BLOCK_BYTES, make_engine

MODEL = "tiny-kvflow"
ROLES = {
    "planner": "You are the planner. Break the task into small numbered steps and say who does each one. " * 4,
    "coder": "You are the coder. Write the code for the current step and explain nothing else at all. " * 4,
    "reviewer": "You are the reviewer. Check the code against the plan and list every problem you find. " * 4,
}
GEN = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def srv(llama_dir, run_server):
    tiers = TierConfig(policy="workflow", host_bytes=256 * TINY_BLOCK_BYTES, load_ahead=2)
    llm = make_engine(llama_dir, num_blocks=40, name=MODEL, reuse=ReuseConfig(enabled=False), tiers=tiers)
    with run_server(llm, MODEL) as server:
        yield server


def test_the_plan_s_step_graph_drives_eviction_and_prefetch(srv, start_gateway):
    gw = start_gateway([srv.base_url])
    transcript = "Task: add two numbers."
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=30) as client:
        for _ in range(4):
            for role, system in ROLES.items():
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": transcript}],
                    **GEN)
                transcript += f"\n{role}: {reply.choices[0].message.content}"
    assert srv.wait_idle(10)
    agents = srv.llm.workflows.agents()
    assert len(agents) == 3 and len({a.app_id for a in agents}) == 1
    assert all(num_blocks >= 4 for _, num_blocks in agents.values())  # each role's fixed prefix
    stats = srv.llm.tiers.stats
    assert stats.num_backed_up > 0 and stats.num_prefetched > 0
