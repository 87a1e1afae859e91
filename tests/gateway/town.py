"""A small multi-agent session for the TTFT report and /ui tests: three villagers speak,
then all read each other (one alone, two at once: an All-Gather round), through the
gateway to an embedded SmolLM2 engine (real text, so the gateway finds the outputs)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from engine_ext.config import EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from kvrelay.gateway.settings import Timeouts

MODEL = "smollm2"
SESSION = "town"
NUM_REQUESTS = 6
# A non-streamed answer's first byte is its last: 24 tokens of a real model take 1-4 s on
# two idle cores, more on a loaded machine (the test fixtures' 5 s cut it off there).
TOWN_TIMEOUTS = Timeouts(connect_s=5.0, first_byte_s=120.0, idle_s=120.0, total_s=300.0)


def town_engine(smollm2_dir: Path) -> LLMEngine:
    """An engine whose town opted into approximate reuse (blend, with TokenDance rounds):
    the reports and pages under test show what reuse did."""
    return LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=256 * 2**20, reuse=ReuseConfig(default_method="blend")),
                     model_name=MODEL)


def _ask(client: openai.OpenAI, agent: int, content: str) -> str:
    system = f"You are villager {agent} of a small town. Reply with one sentence."
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24,
                                       extra_headers={"x-kvrelay-session-id": SESSION},
                                       messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": content}])
    return r.choices[0].message.content


def run_town_session(gateway_v1: str) -> None:
    with openai.OpenAI(base_url=gateway_v1, api_key="unused", max_retries=0) as client:
        outputs = [_ask(client, k, f"Day starts. Your plan number {k}.") for k in range(3)]
        heard = "What your neighbours said:\n\n" + "\n\n".join(outputs) + "\n\nWhat next?"
        _ask(client, 0, heard)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda k: _ask(client, k, heard), (1, 2)))
