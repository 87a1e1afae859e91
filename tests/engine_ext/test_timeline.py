"""The engine stamps each request's timeline: contiguous stages that add up to its TTFT,
a queue stage while it waits for room, and the KV assembly of each reuse method inside
its prefill."""

from __future__ import annotations

import random

import pytest

from engine_ext.config import EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.reuse.segments import TokenSegment
from engine_ext.sampling import SamplingParams
from engine_ext.timeline import PrefillRate, breakdown
from tests.helpers import kv_bytes, make_engine


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
    first = eng.add_request("a", tokens(30, 1), SamplingParams(max_tokens=3, temperature=0.0))
    second = eng.add_request("b", tokens(30, 2), SamplingParams(max_tokens=3, temperature=0.0))
    while eng.has_work:
        eng.step()
    assert second.timeline.admitted >= first.timeline.finished
    assert second.timeline.stages()["queue"].seconds >= first.timeline.stages()["decode"].seconds


def test_chunked_prefill_splits_into_compute_steps_and_the_wait_between(llama_dir):
    eng = make_engine(llama_dir, 64, max_num_batched_tokens=16)
    other = eng.add_request("other", tokens(10, 9), SamplingParams(max_tokens=8, temperature=0.0))
    eng.step()  # `other` is decoding while the long prompt is chunked
    seq = eng.add_request("long", tokens(40, 3), SamplingParams(max_tokens=1, temperature=0.0))
    while eng.has_work:
        eng.step()
    line = seq.timeline
    prefill = line.stages()["prefill"]
    assert line.num_prefill_steps == 3 and all(prefill.holds(step) for step in line.prefill_steps)
    assert line.prefill_compute_s() == sum(step.seconds for step in line.prefill_steps)  # nothing placed
    report = breakdown(line, seq.num_prompt_tokens, None)
    assert report["prefill_wait_s"] == pytest.approx(prefill.seconds - report["prefill_compute_s"], abs=1e-9)
    assert report["prefill_wait_s"] > 0  # the steps between chunks
    assert other.timeline.finished is not None


def test_the_prefill_rate_learns_from_dense_prefill_steps_alone(llama_dir, monkeypatch):
    eng = make_engine(llama_dir, 64)
    observed: list[int] = []
    monkeypatch.setattr(eng.prefill_rate, "observe", lambda n, s: observed.append(n))
    eng.add_request("a", tokens(30, 1), SamplingParams(max_tokens=4, temperature=0.0))
    eng.step()  # a's prefill alone
    eng.add_request("b", tokens(20, 2), SamplingParams(max_tokens=1, temperature=0.0))
    eng.step()  # b's prefill with a's decode row: the decode would slow the sample
    eng.step()  # a decodes alone
    assert observed == [30]


def test_kv_assembly_of_each_method_lies_inside_the_prefill(llama_dir):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_bytes=kv_bytes(96),
                                            reuse=ReuseConfig(min_segment_tokens=4, check_layers=(0,))))
    doc, prefix = tokens(40, 4), tokens(20, 5)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    eng.generate(doc, greedy, segments=[TokenSegment(0, 40, "shared_block", None, None, 0)], publish=False)
    seq = eng.generate(prefix + doc + tokens(6, 6), greedy, publish=False,
                       segments=[TokenSegment(20, 60, "shared_block", None, "shift", 0)])
    line = seq.timeline
    (placement,) = line.assembly["shift"]
    (step,) = line.prefill_steps
    assert placement.num_tokens == 40 and step.holds(placement)  # placed inside the step that computed the rest
    assert line.prefill_compute_s() == pytest.approx(step.seconds - placement.seconds)


def test_prefill_rate_averages_and_ignores_empty_samples():
    rate = PrefillRate(smoothing=0.5)
    rate.observe(0, 1.0)
    assert rate.tokens_per_s is None
    rate.observe(100, 1.0)
    rate.observe(300, 1.0)
    assert rate.tokens_per_s == 200.0


def test_the_breakdown_prices_a_dense_prefill_with_the_engine_s_rate(llama_dir):
    eng = make_engine(llama_dir, 64)
    eng.generate(tokens(40, 7), SamplingParams(max_tokens=1, temperature=0.0))  # measures the rate
    seq = eng.generate(tokens(40, 8), SamplingParams(max_tokens=2, temperature=0.0))
    rate = eng.prefill_rate.tokens_per_s
    report = breakdown(seq.timeline, seq.num_prompt_tokens, rate)
    assert rate > 0 and report["ttft_s"] == seq.timeline.ttft
    parts = sum(report[f"{name}_s"] for name in ("queue", "plan", "prefill", "first"))
    assert parts == report["ttft_s"]
    # Queue, plan, wait and first token as measured; the prompt's compute priced at the rate.
    assert report["dense_ttft_s"] == pytest.approx(
        report["ttft_s"] - report["prefill_compute_s"] + seq.num_prompt_tokens / rate, abs=1e-9)
    assert report["saved_s"] == report["dense_ttft_s"] - report["ttft_s"]
    assert "dense_ttft_s" not in breakdown(seq.timeline, seq.num_prompt_tokens, None)
