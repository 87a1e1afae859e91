"""TokenDance end to end with SmolLM2: an unmodified OpenAI-client All-Gather round ->
gateway (detects the round, names it in the plan) -> embedded engine (groups the round's
requests, prefills them collectively, stores their caches as master and mirror)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from engine_ext.config import CollectiveConfig, EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine

MODEL = "smollm2"
NUM_AGENTS = 3
SESSION = {"x-session-id": "town"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(smollm2_dir, run_server):
    # A window lets the round's first request wait for its siblings (they come concurrently).
    reuse = ReuseConfig(min_segment_tokens=8, collective=CollectiveConfig(window_ms=500))
    llm = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=512 * 2**20, reuse=reuse), model_name=MODEL)
    with run_server(llm, MODEL) as server:
        yield server


def _ask(client: openai.OpenAI, agent: int, content: str) -> openai.types.chat.ChatCompletion:
    system = f"You are villager {agent} of a small town. Reply with one sentence about your plans."
    return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, extra_headers=SESSION,
                                          messages=[{"role": "system", "content": system},
                                                    {"role": "user", "content": content}])


def _round_prompt(outputs: list[str], agent: int) -> str:
    shown = outputs[:]
    random.Random(agent).shuffle(shown)  # every agent reads the outputs in its own order
    return "What your neighbours said:\n\n" + "\n\n".join(shown) + "\n\nWhat will you do next?"


def test_an_all_gather_round_is_prefilled_collectively(srv, start_gateway):
    gw = start_gateway([srv.base_url], approximation={"rules": [{"method": "blend"}]})  # collective reuse is blend: opted in
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=300) as client:
        plans = ["buy bread at the market", "repair the old mill", "paint the school fence"]
        outputs = [_ask(client, i, f"Day starts. Your own plan: {plans[i]}.").choices[0].message.content
                   for i in range(NUM_AGENTS)]
        # The first reader runs alone; the other two arrive together and are prefilled as one group.
        first = _ask(client, 0, _round_prompt(outputs, 0))
        with ThreadPoolExecutor(2) as pool:
            rest = list(pool.map(lambda i: _ask(client, i, _round_prompt(outputs, i)), (1, 2)))

    lone = first.model_extra["kv_transfer_params"]["kvrelay_reuse"]
    assert all("collective" not in s for s in lone["segments"])
    reports = [r.model_extra["kv_transfer_params"]["kvrelay_reuse"] for r in rest]
    groups = []
    for report in reports:
        placed = [s for s in report["segments"] if s["kind"] == "placeholder"]
        assert len(placed) == NUM_AGENTS, report
        assert all(s["method"] == "blend" and "collective" in s for s in placed), report
        groups.append(placed[0]["collective"])
    assert {g["group_size"] for g in groups} == {2} and len({g["round"] for g in groups}) == 1
    assert sorted(g["is_master"] for g in groups) == [False, True]
    for r, report in zip(rest, reports):
        assert r.usage.prompt_tokens_details.cached_tokens >= report["tokens_reused"] > 0
    stats = srv.llm.diff_store.stats()
    # The group: one master and one mirror. The first reader, alone, ran on placed (approximate)
    # KV too, so its prompt was kept for its next turn, as a master of its own.
    assert (stats["masters"], stats["mirrors"]) == (2, 1)
