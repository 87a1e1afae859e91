"""Reuse of cached segments at new positions, end to end through LLMEngine on a tiny model."""

from __future__ import annotations

import random

import pytest
import torch

from engine_ext.config import EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.reuse.segments import TokenSegment
from engine_ext.sampling import SamplingParams
from tests.helpers import kv_bytes

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def deep_llama(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=4)


def engine(model_dir, num_blocks=96, **reuse):
    reuse.setdefault("check_layers", (0,))
    reuse.setdefault("min_segment_tokens", 4)
    # The 4-layer model's blocks are twice the size kv_bytes assumes for the 2-layer ones.
    eng = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=2 * kv_bytes(num_blocks), reuse=ReuseConfig(**reuse)))
    assert eng.kv_cache.num_blocks == num_blocks
    return eng


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 200) for _ in range(n)]


def doc_segment(start: int, n: int, method: str | None = None) -> TokenSegment:
    return TokenSegment(start, start + n, "shared_block", None, method, 0)


def cache_alone(eng, doc: list[int]) -> None:
    """Prefill the document alone (its KV registered at position 0), like KVLink's precompute."""
    eng.generate(doc, GREEDY, segments=[doc_segment(0, len(doc))], publish=False)


def last_logits(eng, prompt, segments=None, publish=False) -> tuple[torch.Tensor, object]:
    seq = eng.generate(prompt, GREEDY, segments=segments, publish=publish, record_logits=True)
    return seq.logits[0], seq


def test_blend_with_ratio_one_equals_dense(deep_llama):
    eng = engine(deep_llama, blend_ratio=1.0)
    doc, prefix, question = tokens(40, 1), tokens(23, 2), tokens(9, 3)
    cache_alone(eng, doc)
    prompt = prefix + doc + question
    reused, seq = last_logits(eng, prompt, [doc_segment(len(prefix), len(doc), "blend")])
    dense, _ = last_logits(eng, prompt)
    (outcome,) = seq.reuse_outcomes
    assert outcome.method == "blend" and outcome.num_recomputed == len(doc) and outcome.num_reused == 0
    torch.testing.assert_close(reused, dense, atol=1e-4, rtol=1e-4)


def test_unchanged_preceding_context_reproduces_dense(deep_llama):
    eng = engine(deep_llama)
    prefix, doc = tokens(21, 4), tokens(37, 5)
    seg = doc_segment(len(prefix), len(doc), "shift")
    eng.generate(prefix + doc + tokens(5, 6), GREEDY, segments=[seg], publish=False)  # registers the doc in context
    prompt = prefix + doc + tokens(7, 7)
    reused, seq = last_logits(eng, prompt, [seg])
    dense, _ = last_logits(eng, prompt)
    (outcome,) = seq.reuse_outcomes
    assert outcome.method == "shift" and outcome.num_reused == len(doc)
    torch.testing.assert_close(reused, dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["shift", "blend", "link"])
def test_methods_report_reuse_and_count_cached_tokens(deep_llama, method):
    eng = engine(deep_llama, blend_ratio=0.25, link_tokens=3)
    doc, prefix, question = tokens(40, 8), tokens(19, 9), tokens(6, 10)
    cache_alone(eng, doc)
    _, seq = last_logits(eng, prefix + doc + question, [doc_segment(len(prefix), len(doc), method)])
    (outcome,) = seq.reuse_outcomes
    expected_recomputed = {"shift": 0, "blend": 10, "link": 3}[method]
    assert (outcome.method, outcome.num_recomputed) == (method, expected_recomputed)
    assert outcome.num_reused == len(doc) - expected_recomputed
    assert seq.num_cached_tokens == outcome.num_reused


def test_generated_output_is_reused_by_the_next_request(deep_llama):
    eng = engine(deep_llama)
    prompt_a = tokens(30, 11)
    free = eng.generate(prompt_a, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    answer = free.output_token_ids
    stop = answer[20]
    cut = answer.index(stop)  # greedy repeats itself: it stops at the first occurrence
    sampling = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,))
    first = eng.generate(prompt_a, sampling, segments=[TokenSegment(0, 30, "private")])
    assert first.finish_reason == "stop" and first.output_token_ids == answer[: cut + 1]
    produced = answer[:cut]
    assert len(produced) >= 4
    other = tokens(17, 12)
    prompt_b = other + produced + tokens(5, 13)
    _, seq = last_logits(eng, prompt_b, [TokenSegment(len(other), len(other) + cut, "placeholder", "agent_a_current",
                                                      "shift", 1)])
    (outcome,) = seq.reuse_outcomes
    assert outcome.method == "shift" and outcome.num_reused == cut


def test_token_mismatch_falls_back_to_dense(deep_llama):
    eng = engine(deep_llama)
    doc = tokens(40, 14)
    cache_alone(eng, doc)
    changed = doc[:-1] + [doc[-1] + 1]
    prefix = tokens(10, 15)
    prompt = prefix + changed + tokens(4, 16)
    reused, seq = last_logits(eng, prompt, [doc_segment(len(prefix), len(doc), "shift")])
    dense, _ = last_logits(eng, prompt)
    (outcome,) = seq.reuse_outcomes
    assert outcome.method == "dense" and outcome.num_reused == 0 and "segment index" in outcome.reason
    torch.testing.assert_close(reused, dense)


def test_evicted_segment_falls_back_to_dense(deep_llama):
    eng = engine(deep_llama, num_blocks=12)  # 192 tokens of KV
    doc = tokens(40, 17)
    cache_alone(eng, doc)
    assert eng.segment_index.lookup(doc) is not None
    for seed in range(4):  # unrelated prompts push the document's blocks out of the LRU
        eng.generate(tokens(150, 100 + seed), GREEDY)
    prefix = tokens(10, 18)
    _, seq = last_logits(eng, prefix + doc + tokens(4, 19), [doc_segment(len(prefix), len(doc), "shift")])
    (outcome,) = seq.reuse_outcomes
    assert outcome.method == "dense" and "evicted" in outcome.reason


def test_segments_share_the_kv_budget(deep_llama):
    eng = engine(deep_llama, num_blocks=12)
    pool = eng.kv.pool
    for seed in range(6):  # more documents than fit: the oldest are evicted, never an overflow
        cache_alone(eng, tokens(40, 200 + seed))
        assert eng.segment_index.num_blocks <= pool.num_blocks
        assert pool.num_free == pool.num_blocks  # nothing pinned once requests finish
    assert eng.segment_index.lookup(tokens(40, 205)) is not None
    assert eng.segment_index.lookup(tokens(40, 200)) is None


def test_approximate_blocks_are_not_published(deep_llama):
    eng = engine(deep_llama)
    doc, prefix = tokens(48, 20), tokens(32, 21)
    cache_alone(eng, doc)
    prompt = prefix + doc + tokens(20, 22)
    eng.generate(prompt, GREEDY, segments=[doc_segment(32, 48, "shift")])
    seq = eng.generate(prompt, GREEDY)  # no plan: only the exact prefix may come from the cache
    assert seq.num_cached_tokens == 32
