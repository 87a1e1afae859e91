"""An All-Gather round on the tiny 4-layer model: shared outputs cached alone, then one
prompt per agent (its private history, every output in its own order, a task)."""

from __future__ import annotations

import random
from typing import NamedTuple

from engine_ext.config import CollectiveConfig, EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from kvrelay.wire.plan import RoundInfo
from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.sampling import SamplingParams
from engine_ext.sequence import Sequence
from tests.helpers import kv_bytes
from engine_ext.request import EngineRequest

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
SEPARATOR = [7, 8]


def engine(model_dir, num_blocks: int = 192, collective: CollectiveConfig | None = None, **reuse) -> LLMEngine:
    reuse.setdefault("check_layers", (1,))
    reuse.setdefault("min_segment_tokens", 4)
    reuse.setdefault("default_method", "blend")  # rounds reuse approximately: opted in, as the gateway's rules would
    config = ReuseConfig(collective=collective or CollectiveConfig(), **reuse)
    # The 4-layer model's blocks are twice the size kv_bytes assumes for the 2-layer ones.
    return LLMEngine(model_dir, EngineConfig(kv_cache_bytes=2 * kv_bytes(num_blocks), reuse=config))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 300) for _ in range(n)]


class Round(NamedTuple):
    outputs: list[list[int]]
    histories: list[list[int]]
    task: list[int]

    @classmethod
    def make(cls, num_agents: int = 3, output_len: int = 40, seed: int = 0) -> Round:
        outputs = [tokens(output_len + 7 * i, seed * 100 + i) for i in range(num_agents)]
        histories = [tokens(20 + 5 * i, seed * 100 + 50 + i) for i in range(num_agents)]
        return cls(outputs, histories, tokens(6, seed * 100 + 99))

    def cache_outputs(self, eng: LLMEngine) -> None:
        """Each output prefilled alone, as the engine registers an agent's answer."""
        for out in self.outputs:
            eng.generate(out, GREEDY, segments=[TokenSegment(0, len(out), "placeholder", "x")], publish=False)

    def prompt(self, agent: int, method: str | None = "blend",
               without_self: bool = False) -> tuple[list[int], list[TokenSegment]]:
        """`without_self`: the agent reads the others' outputs, not its own."""
        n = len(self.outputs)
        ids, segments = list(self.histories[agent]), []
        for j in [(agent + k) % n for k in range(1 if without_self else 0, n)]:  # each in its own order
            ids += SEPARATOR
            segments.append(TokenSegment(len(ids), len(ids) + len(self.outputs[j]), "placeholder",
                                         f"agent_{j}_current", method, j))
            ids += self.outputs[j]
        return ids + self.task, segments

    def add(self, eng: LLMEngine, round_id: str | None = "round-1", method: str | None = "blend",
            agents: list[int] | None = None, record_logits: bool = True, publish: bool = False,
            max_tokens: int = 1, size: int | None = None, without_self: bool = False) -> list[Sequence]:
        """Queue every agent's request of the round (not yet run)."""
        agents = list(range(len(self.outputs))) if agents is None else agents
        seqs = []
        for i in agents:
            ids, segments = self.prompt(i, method, without_self)
            info = RoundInfo(id=round_id, size=size or len(agents), index=i) if round_id else None
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            seq = eng.add_request(EngineRequest(f"agent{i}-{round_id}-{len(seqs)}", ids, sampling, segments=segments,
                                  scope=ReuseScope("app", f"agent{i}", info), publish=publish))
            seq.logits = [] if record_logits else None
            seqs.append(seq)
        return seqs


def run_all(eng: LLMEngine) -> None:
    while eng.has_work:
        eng.step()
