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
    reuse.setdefault("default_method", "blend")  # approximate reuse under test: opted in for the whole engine
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


def test_blend_that_would_recompute_whole_is_computed_densely(deep_llama):
    """The cost model: blend at ratio 1.0 computes every token of the segment plus the
    check layers, more than computing it, so the segment is computed densely."""
    eng = engine(deep_llama, blend_ratio=1.0)
    doc, prefix, question = tokens(40, 1), tokens(23, 2), tokens(9, 3)
    cache_alone(eng, doc)
    prompt = prefix + doc + question
    reused, seq = last_logits(eng, prompt, [doc_segment(len(prefix), len(doc), "blend")])
    dense, _ = last_logits(eng, prompt)
    (outcome,) = seq.reuse_outcomes
    assert outcome.method == "dense" and outcome.num_recomputed == len(doc) and outcome.num_reused == 0
    assert outcome.reason == "blend would compute as many tokens as computing it"
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


def test_an_answer_cut_by_length_is_kept_whole_with_exact_kv(deep_llama):
    """Frameworks cap max_tokens: an answer that ends by length is kept too. Its last
    token was sampled, never computed; the engine computes its KV, so the kept answer
    is what a dense prefill of prompt + answer writes, position for position."""
    eng = engine(deep_llama)
    prompt = tokens(30, 14)
    first = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         segments=[TokenSegment(0, 30, "private")])
    assert first.finish_reason == "length"
    answer = first.output_token_ids
    entry = eng.segment_index.lookup(answer)
    assert entry is not None and entry.token_ids == tuple(answer)
    other = tokens(17, 15)
    _, seq = last_logits(eng, other + answer + tokens(5, 16),
                         [TokenSegment(len(other), len(other) + len(answer), "placeholder", "agent_a_current", "shift", 1)])
    (outcome,) = seq.reuse_outcomes
    assert outcome.method == "shift" and outcome.num_reused == len(answer)
    # The kept KV is what another engine keeps from a dense prefill of prompt + answer.
    kept = eng.segment_index.slots(entry)
    fresh = engine(deep_llama)
    fresh.generate(prompt + answer, GREEDY, segments=[TokenSegment(30, 30 + len(answer), "shared_block")],
                   publish=False)
    again = fresh.segment_index.lookup(answer)
    assert again is not None
    for (k_a, v_a), (k_b, v_b) in zip(eng.kv_cache.layers, fresh.kv_cache.layers):
        torch.testing.assert_close(k_a.index_select(0, kept), k_b.index_select(0, fresh.segment_index.slots(again)),
                                   atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v_a.index_select(0, kept), v_b.index_select(0, fresh.segment_index.slots(again)),
                                   atol=1e-5, rtol=1e-4)


def test_an_answer_ended_by_a_stop_string_is_kept_as_its_text(deep_llama):
    eng = engine(deep_llama)
    prompt = tokens(30, 17)
    free = eng.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    text = eng.tokenizer.decode(free.output_token_ids)
    # A stop string that starts on a token edge deep in the answer: the tokens before it are the text.
    cut = next(k for k in range(8, len(free.output_token_ids))
               if eng.tokenizer.decode(free.output_token_ids[k:k + 1]).strip()
               and text.find(eng.tokenizer.decode(free.output_token_ids[k:k + 1])) ==
               len(eng.tokenizer.decode(free.output_token_ids[:k])))
    stop = eng.tokenizer.decode(free.output_token_ids[cut:cut + 1])
    first = eng.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)),
                         segments=[TokenSegment(0, 30, "private")])
    assert first.finish_reason == "stop"
    assert eng.segment_index.lookup(free.output_token_ids[:cut]) is not None


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


@pytest.mark.parametrize("method", ["shift", "blend"])
def test_a_turn_after_an_approximate_one_computes_no_more_than_prefix_caching(deep_llama, method):
    """An approximate placement keeps its blocks out of the prefix cache; the prompt is
    stored instead, so the agent's next turn (which extends it) restores the KV it ran
    on rather than losing every prefix hit from the first placed token on."""
    doc, head, q1, q2 = tokens(40, 20), tokens(19, 21), tokens(9, 22), tokens(7, 23)
    computed = {}
    for name, reuse in (("approximate", method), ("prefix", "prefix")):
        eng = engine(deep_llama, num_blocks=160, default_method=reuse)
        cache_alone(eng, doc)
        seg = doc_segment(len(head), len(doc))
        turn1 = head + doc + q1
        first = eng.generate(turn1, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), segments=[seg])
        turn2 = turn1 + first.output_token_ids + q2
        second = eng.generate(turn2, GREEDY, segments=[seg])
        computed[name] = (first.num_prompt_tokens - first.num_cached_tokens,
                          second.num_prompt_tokens - second.num_cached_tokens)
        if name == "approximate":
            assert [o.method for o in first.reuse_outcomes] == [method]
            assert [o.method for o in second.reuse_outcomes] == ["restored"]
    assert computed["approximate"][0] < computed["prefix"][0]  # the placed document saved turn 1's prefill
    assert computed["approximate"][1] <= computed["prefix"][1]  # and turn 2 lost nothing to it


def test_an_exact_prompt_with_segments_leaves_nothing_behind(deep_llama, monkeypatch):
    """Under the exact default a plan's segments only describe the prompt: keeping it
    after its prefill registers nothing and looks up no more cache slots than the same
    prompt without a plan (the model runner's own lookups)."""
    doc, tail = tokens(48, seed=3), tokens(8, seed=4)
    lookups = []
    for segments in (None, [doc_segment(0, len(doc))]):
        eng = engine(deep_llama, default_method="prefix")
        slots = eng.kv.slots
        calls = []
        monkeypatch.setattr(eng.kv, "slots", lambda seq, end, calls=calls, slots=slots: calls.append(end) or
                            slots(seq, end))
        eng.generate(doc + tail, GREEDY, segments=segments)
        lookups.append(calls)
        assert eng.segment_index.lookup(doc) is None
    assert lookups[1] == lookups[0]
