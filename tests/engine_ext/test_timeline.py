"""The engine stamps each request's timeline: contiguous stages that add up to its TTFT,
a queue stage while it waits for room, and the KV assembly of each reuse method inside
its prefill; and notes what prefix caching alone would have done for the prompt, so the
breakdown prices reuse against that (the prefill-time fit, the shadow prefix cache)."""

from __future__ import annotations

import random

import pytest

from engine_ext.config import EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.reuse.segments import TokenSegment
from engine_ext.sampling import SamplingParams
from engine_ext.timeline import PrefillRate, PrefixShadow, breakdown
from tests.helpers import kv_bytes, make_engine
from engine_ext.request import EngineRequest


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 200) for _ in range(n)]


def test_stages_are_contiguous_and_add_up_to_the_ttft(llama_dir):
    eng = make_engine(llama_dir, 64)
    seq = eng.generate(tokens(40, 1), SamplingParams(max_tokens=4, temperature=0.0))
    line = seq.timeline
    stages = line.stages()
    assert list(stages) == ["queue", "plan", "prefill", "first", "decode"]
    edges = [(s.start, s.end) for s in stages.values()]
    assert all(a_end == b_start for (_, a_end), (b_start, _) in zip(edges, edges[1:]))
    assert all(s.seconds >= 0 for s in stages.values())
    assert sum(stages[n].seconds for n in ("queue", "plan", "prefill", "first")) == line.ttft
    assert line.num_prefill_steps == 1 and line.finished >= line.first_token


def test_a_request_that_waits_for_room_shows_it_as_queue(llama_dir):
    eng = make_engine(llama_dir, 64, max_num_seqs=1)
    first = eng.add_request(EngineRequest("a", tokens(30, 1), SamplingParams(max_tokens=3, temperature=0.0)))
    second = eng.add_request(EngineRequest("b", tokens(30, 2), SamplingParams(max_tokens=3, temperature=0.0)))
    while eng.has_work:
        eng.step()
    assert second.timeline.admitted >= first.timeline.finished
    assert second.timeline.stages()["queue"].seconds >= first.timeline.stages()["decode"].seconds


def test_chunked_prefill_splits_into_compute_steps_and_the_wait_between(llama_dir):
    eng = make_engine(llama_dir, 64, max_num_batched_tokens=16)
    other = eng.add_request(EngineRequest("other", tokens(10, 9), SamplingParams(max_tokens=8, temperature=0.0)))
    eng.step()  # `other` is decoding while the long prompt is chunked
    seq = eng.add_request(EngineRequest("long", tokens(40, 3), SamplingParams(max_tokens=1, temperature=0.0)))
    while eng.has_work:
        eng.step()
    line = seq.timeline
    prefill = line.stages()["prefill"]
    assert line.num_prefill_steps == 3 and all(prefill.holds(step) for step in line.prefill_steps)
    assert line.prefill_compute_s() == sum(step.seconds for step in line.prefill_steps)  # nothing placed
    report = breakdown(line, seq.num_prompt_tokens).to_json()
    assert report["prefill_wait_s"] == pytest.approx(prefill.seconds - report["prefill_compute_s"], abs=1e-9)
    assert report["prefill_wait_s"] > 0  # the steps between chunks
    assert other.timeline.finished is not None


def test_the_prefill_rate_learns_from_dense_prefill_steps_alone(llama_dir, monkeypatch):
    eng = make_engine(llama_dir, 64)
    observed: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(eng.prefill_rate, "observe", lambda chunks, s: observed.append(chunks))
    eng.add_request(EngineRequest("a", tokens(30, 1), SamplingParams(max_tokens=4, temperature=0.0)))
    eng.step()  # a's prefill alone
    eng.add_request(EngineRequest("b", tokens(20, 2), SamplingParams(max_tokens=1, temperature=0.0)))
    eng.step()  # b's prefill with a's decode row: the decode would slow the sample
    while eng.has_work:
        eng.step()  # a decodes alone
    eng.add_request(EngineRequest("c", tokens(30, 1) + tokens(20, 3), SamplingParams(max_tokens=1, temperature=0.0)))
    eng.step()  # c's prefill after a prefix hit: a's first block
    assert observed == [[(30, 0)], [(34, 16)]]  # (tokens computed, tokens cached before them)


def test_kv_assembly_of_each_method_lies_inside_the_prefill(llama_dir):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_bytes=kv_bytes(96),
                                            reuse=ReuseConfig(min_segment_tokens=4, check_layers=(0,))))
    doc, prefix = tokens(40, 4), tokens(20, 5)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    eng.generate(doc, greedy, segments=[TokenSegment(0, 40, "shared_block", None, "shift", 0)], publish=False)
    seq = eng.generate(prefix + doc + tokens(6, 6), greedy, publish=False,
                       segments=[TokenSegment(20, 60, "shared_block", None, "shift", 0)])
    line = seq.timeline
    (placement,) = line.assembly["shift"]
    (step,) = line.prefill_steps
    assert placement.num_tokens == 40 and step.holds(placement)  # placed inside the step that computed the rest
    assert line.prefill_compute_s() == pytest.approx(step.seconds - placement.seconds)


def _fitted(a: float = 0.03, b: float = 0.001, c: float = 0.0004) -> PrefillRate:
    """A rate taught a known curve, a + b*n + c*n*ctx/1000, by cold prefills of 32..1024 tokens."""
    rate = PrefillRate(max_chunk_tokens=512)
    for n in (32, 64, 128, 256, 512, 48, 96, 384):
        rate.observe([(n, 0)], a + b * n + c * n * (n / 2) / 1e3)
    return rate


def test_the_prefill_time_fit_recovers_step_cost_per_token_cost_and_attention():
    rate = _fitted()
    # 100 tokens after 1000 cached: each attends to ~1050 tokens, dearer than a cold 100.
    assert rate.seconds(100, 1000) == pytest.approx(0.03 + 0.1 + 0.0004 * 100 * 1050 / 1e3, rel=1e-6)
    assert rate.seconds(100, 1000) > rate.seconds(100, 0)
    # Past a step's budget the engine computes in chunks, each a step of its own.
    assert rate.seconds(700) == pytest.approx(rate.seconds(512) + rate.seconds(188, 512), rel=1e-9)
    assert rate.seconds(0, 500) == 0.0


def test_the_prefill_time_is_unknown_rather_than_guessed():
    rate = PrefillRate()
    rate.observe([(8, 0)], 0.01)  # too few tokens: all fixed cost
    rate.observe([(0, 0)], 1.0)
    rate.observe([(100, 0)], 0.0)
    assert rate.num_samples == 0
    for n in (100, 110, 120):  # one length alone cannot tell step cost from per-token cost
        rate.observe([(n, 0)], 0.05 + 0.001 * n)
    assert rate.seconds(100) is None
    rate.observe([(40, 0)], 0.09)
    rate.observe([(400, 0)], 0.45)
    assert rate.seconds(100) is not None and rate.seconds(600) is not None  # within a power of two of one seen
    assert rate.seconds(8) is None and rate.seconds(2000) is None  # nothing like them measured
    assert min(rate._fit()) >= 0


def test_a_noisy_fit_keeps_its_coefficients_non_negative():
    rate = PrefillRate()
    for n, seconds in ((32, 0.2), (64, 0.1), (128, 0.12), (256, 0.2), (512, 0.35)):  # a slow first step
        rate.observe([(n, 0)], seconds)
    assert min(rate._fit()) >= 0 and rate.seconds(32) > 0


def test_the_shadow_prefix_cache_keeps_the_most_recently_used_blocks():
    shadow = PrefixShadow(capacity=3)
    shadow.add([b"a", b"b", b"c"])
    assert shadow.hit([b"a", b"b", b"x", b"c"]) == 2  # a run from the start only; a and b are used again
    shadow.add([b"d"])  # c, the least recently used, leaves
    assert shadow.hit([b"c"]) == 0 and shadow.hit([b"a", b"b", b"d"]) == 3


def test_without_reuse_beyond_the_prefix_cache_nothing_is_saved(llama_dir):
    """Reuse off, or an exact plan that places nothing: the request did the prefix path's
    own work, so it saved exactly 0 (no noise from a priced estimate)."""
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    shared = tokens(40, 7)
    for reuse in (ReuseConfig(enabled=False), ReuseConfig(default_method="prefix", min_segment_tokens=4)):
        eng = LLMEngine(llama_dir, EngineConfig(kv_cache_bytes=kv_bytes(96), reuse=reuse))
        eng.prefill_rate = _fitted()  # a known price: still not used
        segments = [TokenSegment(0, 40, "shared_block", None, None, 0)]
        first = eng.generate(shared + tokens(10, 8), greedy, segments=segments)
        second = eng.generate(shared + tokens(12, 9), greedy, segments=segments)
        for seq in (first, second):
            report = breakdown(seq.timeline, seq.num_prompt_tokens).to_json()
            assert report["saved_s"] == 0.0 and report["dense_ttft_s"] == report["ttft_s"], reuse
            assert report["reused_tokens"] == 0 and "prefix_path_s" not in report
        assert breakdown(second.timeline, second.num_prompt_tokens).to_json()["prefix_hit_tokens"] == 32  # 2 blocks of 40


def test_a_placed_segment_is_priced_against_the_prefix_path(llama_dir):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_bytes=kv_bytes(96),
                                            reuse=ReuseConfig(min_segment_tokens=4, check_layers=(0,))))
    doc, prefix = tokens(40, 4), tokens(20, 5)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    eng.generate(doc, greedy, segments=[TokenSegment(0, 40, "shared_block", None, "shift", 0)], publish=False)
    eng.prefill_rate = _fitted()
    seq = eng.generate(prefix + doc + tokens(6, 6), greedy, publish=False,
                       segments=[TokenSegment(20, 60, "shared_block", None, "shift", 0)])
    report = breakdown(seq.timeline, seq.num_prompt_tokens).to_json()
    assert report["reused_tokens"] == 40 and report["prefix_hit_tokens"] == 0  # the doc alone was never a prefix
    assert report["prefix_path_tokens"] == 66
    assert report["prefix_path_s"] == pytest.approx(eng.prefill_rate.seconds(66))
    assert report["keep_s"] > 0  # its segment went to the index, before its first token
    cost = report["prefill_compute_s"] + report["assembly_s"]["shift"] + report["keep_s"]
    assert report["saved_s"] == pytest.approx(report["prefix_path_s"] - cost, abs=1e-9)
    assert report["dense_ttft_s"] == pytest.approx(report["ttft_s"] + report["saved_s"], abs=1e-9)


def test_prefix_hits_lost_to_approximate_kv_count_against_reuse(llama_dir):
    """A prompt placed with approximate KV publishes nothing past its first placed token;
    the next prompt extending it gets a shorter exact hit than prefix caching alone would
    have given it. The baseline is that longer hit (the shadow cache), not the real one."""
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_bytes=kv_bytes(96),
                                            reuse=ReuseConfig(min_segment_tokens=4, check_layers=(0,))))
    doc, prefix = tokens(40, 4), tokens(20, 5)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    eng.generate(doc, greedy, segments=[TokenSegment(0, 40, "shared_block", None, "shift", 0)], publish=False)
    placed = prefix + doc + tokens(6, 6)
    eng.generate(placed, greedy, segments=[TokenSegment(20, 60, "shared_block", None, "shift", 0)])
    eng.prefill_rate = _fitted()
    price = eng.prefill_rate.seconds(22, 64)  # before this request's own dense prefill teaches the rate
    seq = eng.generate(placed + tokens(20, 7), greedy)
    report = breakdown(seq.timeline, seq.num_prompt_tokens).to_json()
    assert seq.timeline.num_exact_hit == 16  # the real cache: the block before the placed doc
    assert report["prefix_hit_tokens"] == 64 and report["prefix_path_tokens"] == 22  # prefix caching alone
    assert report["reused_tokens"] == 0 and report["prefix_path_s"] == pytest.approx(price)
    assert report["keep_s"] == 0.0  # no plan: nothing kept for reuse
    assert report["saved_s"] == pytest.approx(report["prefix_path_s"] - report["prefill_compute_s"], abs=1e-9)
