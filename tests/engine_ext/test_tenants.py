"""Every engine cache is namespaced by tenant: a tenant never reuses (so never times)
what another computed, and reuses its own as before."""

from __future__ import annotations

import random

from engine_ext.config import EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.sampling import SamplingParams
from tests.helpers import kv_bytes

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 200) for _ in range(n)]


def scope(tenant: str) -> ReuseScope:
    return ReuseScope("app", "agent", tenant=tenant)


def engine(llama_dir) -> LLMEngine:
    return LLMEngine(llama_dir, EngineConfig(kv_cache_bytes=kv_bytes(128),
                                             reuse=ReuseConfig(min_segment_tokens=4, check_layers=(0,))))


def test_the_prefix_cache_is_per_tenant(llama_dir):
    eng, prompt = engine(llama_dir), tokens(64, 1)
    first = eng.generate(prompt, GREEDY, scope=scope("a"))
    other = eng.generate(prompt, GREEDY, scope=scope("b"))
    again = eng.generate(prompt, GREEDY, scope=scope("a"))
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens == 48  # the control: the same tenant hits its own blocks
    assert first.output_token_ids == other.output_token_ids == again.output_token_ids


def test_a_segment_cached_by_one_tenant_is_never_placed_for_another(llama_dir):
    eng, doc = engine(llama_dir), tokens(40, 2)
    eng.generate(doc, GREEDY, segments=[TokenSegment(0, 40, "shared_block", None, "shift", 0)], publish=False,
                 scope=scope("a"))
    prompt = tokens(20, 3) + doc + tokens(6, 4)
    segments = [TokenSegment(20, 60, "shared_block", None, "shift", 0)]
    other = eng.generate(prompt, GREEDY, segments=segments, publish=False, scope=scope("b"))
    own = eng.generate(prompt, GREEDY, segments=segments, publish=False, scope=scope("a"))
    (b_outcome,) = other.reuse_outcomes
    (a_outcome,) = own.reuse_outcomes
    assert b_outcome.method == "dense" and b_outcome.num_reused == 0 and "segment index" in b_outcome.reason
    assert a_outcome.method == "shift" and a_outcome.num_reused == 40


def test_plan_less_requests_share_the_default_tenant(llama_dir):
    eng, prompt = engine(llama_dir), tokens(64, 5)
    eng.generate(prompt, GREEDY)
    assert eng.generate(prompt, GREEDY, scope=scope("default")).num_cached_tokens == 48
    assert eng.generate(prompt, GREEDY, scope=scope("a")).num_cached_tokens == 0
