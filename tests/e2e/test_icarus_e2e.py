"""ICaRus end to end: an agent app sends one model name; the gateway routes each agent to
its adapter, and the embedded engine serves every ICaRus adapter from the one KV cache
(the next agent's turn reuses the whole history), multi-LoRA adapters from their own."""

from __future__ import annotations

import httpx
import pytest

from engine_ext.config import AdapterSpec, ModelConfig, ReuseConfig
from tests.engine_ext.adapters.test_engine_adapters import write_adapter_for
from tests.helpers import make_engine

MODEL = "tiny"
TASK = "Task: plan a three day trip to the coast, then check the plan for problems. " * 6


@pytest.fixture(scope="module")
def srv(llama_dir, run_server, tmp_path_factory):
    cfg = ModelConfig.from_dir(llama_dir)
    root = tmp_path_factory.mktemp("adapters")
    # The icarus adapters are marked as `kvrelay train icarus` marks what it trained (their
    # random factors stand in for trained ones); the multi-LoRA ones are plain PEFT adapters.
    specs = tuple(AdapterSpec(name, str(write_adapter_for(cfg, root / name, seed=i, trained_as=trained_as)), mode)
                  for i, (name, mode, trained_as) in enumerate([("plan", "icarus", "icarus"), ("crit", "icarus", "icarus"),
                                                                ("lplan", "multi_lora", None),
                                                                ("lcrit", "multi_lora", None)]))
    llm = make_engine(llama_dir, num_blocks=64, name=MODEL, reuse=ReuseConfig(enabled=False), adapters=specs)
    with run_server(llm, MODEL) as server:
        yield server


RULES = [{"agent": "planner*", "adapter": "plan"}, {"agent": "critic*", "adapter": "crit"},
         {"agent": "lora-planner*", "adapter": "lplan"}, {"agent": "lora-critic*", "adapter": "lcrit"}]


def _turn(client: httpx.Client, agent: str, session: str, messages: list[dict]) -> dict:
    reply = client.post("/chat/completions", headers={"x-kvrelay-agent-id": agent, "x-kvrelay-session-id": session},
                        json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0,
                              "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("prefix, shares", [("", True), ("lora-", False)])
def test_the_next_agent_on_another_adapter_reuses_the_history(srv, start_gateway, prefix, shares):
    gw = start_gateway([srv.base_url], adapters={"rules": RULES})
    messages = [{"role": "system", "content": TASK}, {"role": "user", "content": "Planner, your turn."}]
    with httpx.Client(base_url=gw.v1, timeout=30) as client:
        first = _turn(client, f"{prefix}planner-1", f"{prefix}trip", messages)
        assert first["model"] == f"{MODEL}:{'l' if prefix else ''}plan"
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Critic, your turn."}]
        second = _turn(client, f"{prefix}critic-1", f"{prefix}trip", messages)
    assert second["model"] == f"{MODEL}:{'l' if prefix else ''}crit"
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    if shares:  # every full block of the planner's prompt, computed once by the base model
        assert cached >= first["usage"]["prompt_tokens"] // 16 * 16 > 0
    else:
        assert cached == 0
