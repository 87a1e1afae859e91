"""Scheduling through a real (tiny) LLMEngine: continuous batching, chunked prefill,
preemption, admission errors and abort."""

from __future__ import annotations

import pytest
import torch

from engine_ext.config import TierConfig
from engine_ext.errors import CapacityError, ContextLengthError, InvalidRequestError
from engine_ext.sampling import SamplingParams
from engine_ext.scheduler import SchedulerOutput
from tests.helpers import make_engine
from engine_ext.request import EngineRequest

GREEDY = dict(temperature=0.0, ignore_eos=True)
# No lower KV tier: these tests count steps and free blocks, and a write-through backup
# keeps its block pinned (and the engine stepping) until the copy lands (tests/engine_ext/tiers).
NO_LOWER_TIER = TierConfig(host_bytes=0)


def prompt(n: int, seed: int, vocab: int = 400) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def record_steps(engine) -> list[list[tuple[str, int]]]:
    """Wrap the scheduler so every step's chunks are recorded as (request_id, num_tokens)."""
    steps: list[list[tuple[str, int]]] = []
    original = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = original()
        steps.append([(c.seq.request_id, c.num_tokens) for c in out.chunks])
        return out

    engine.scheduler.schedule = spy
    return steps


def run_all(engine) -> None:
    for _ in range(10_000):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError("engine did not drain")


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Greedy outputs of each prompt run alone on an engine with plenty of memory."""
    engine = make_engine(llama_dir, num_blocks=64)
    cache: dict[tuple, list[int]] = {}

    def solo(ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(ids), max_tokens)
        if key not in cache:
            engine.kv.pool.reset_cache()  # no prefix hits: a plain, unchunked prefill
            seq = engine.generate(ids, SamplingParams(max_tokens=max_tokens, **GREEDY))
            cache[key] = seq.output_token_ids
        return cache[key]

    return solo


def test_continuous_batching_decodes_several_requests_per_step(llama_dir, reference):
    engine = make_engine(llama_dir, num_blocks=32, tiers=NO_LOWER_TIER)
    steps = record_steps(engine)
    prompts = {f"r{i}": prompt(n, i) for i, n in enumerate((10, 21, 33))}
    seqs = {rid: engine.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=8, **GREEDY)))
            for rid, ids in prompts.items()}
    run_all(engine)
    # step 0 prefills all three together; then every step decodes all three at once
    assert steps[0] == [("r0", 10), ("r1", 21), ("r2", 33)]
    for step in steps[1:]:
        assert sorted(step) == [("r0", 1), ("r1", 1), ("r2", 1)]
    assert len(steps) == 8
    for rid, seq in seqs.items():
        assert seq.finish_reason == "length"
        assert seq.output_token_ids == reference(prompts[rid], 8)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_new_prefill_joins_running_decodes_prefill_first(llama_dir, reference):
    engine = make_engine(llama_dir, num_blocks=32)
    steps = record_steps(engine)
    a, b = prompt(12, 5), prompt(25, 6)
    sa = engine.add_request(EngineRequest("a", a, SamplingParams(max_tokens=6, **GREEDY)))
    engine.step()
    engine.step()
    sb = engine.add_request(EngineRequest("b", b, SamplingParams(max_tokens=6, **GREEDY)))
    engine.step()
    assert steps[2] == [("b", 25), ("a", 1)]  # prefill chunks first, then decodes
    run_all(engine)
    assert sa.output_token_ids == reference(a, 6)
    assert sb.output_token_ids == reference(b, 6)


@pytest.mark.parametrize("budget,length,expected_chunks", [
    (8, 30, [8, 8, 8, 6]),
    (16, 17, [16, 1]),  # the 1-token tail runs through the decode path
    (5, 5, [5]),
])
def test_chunked_prefill_matches_unchunked_output(llama_dir, reference, budget, length, expected_chunks):
    engine = make_engine(llama_dir, num_blocks=32, max_num_batched_tokens=budget)
    steps = record_steps(engine)
    ids = prompt(length, 40 + length)
    seq = engine.add_request(EngineRequest("p", ids, SamplingParams(max_tokens=7, **GREEDY)))
    run_all(engine)
    chunks = [n for step in steps for rid, n in step]
    assert chunks[: len(expected_chunks)] == expected_chunks
    assert chunks[len(expected_chunks):] == [1] * 6  # then one token per decode step
    assert seq.output_token_ids == reference(ids, 7)


def test_chunked_prefill_shares_the_step_budget_with_decodes(llama_dir, reference):
    engine = make_engine(llama_dir, num_blocks=32, max_num_batched_tokens=10)
    steps = record_steps(engine)
    short, long = prompt(6, 7), prompt(40, 8)
    s1 = engine.add_request(EngineRequest("short", short, SamplingParams(max_tokens=12, **GREEDY)))
    engine.step()
    s2 = engine.add_request(EngineRequest("long", long, SamplingParams(max_tokens=5, **GREEDY)))
    run_all(engine)
    for step in steps:
        assert sum(n for _, n in step) <= 10
    # while the long prompt is prefilled, the short one keeps decoding every step
    long_chunks = [(i, n) for i, step in enumerate(steps) for rid, n in step if rid == "long"]
    assert [n for _, n in long_chunks[:5]] == [9, 9, 9, 9, 4]
    for i, _ in long_chunks[:5]:
        assert ("short", 1) in steps[i]
    assert s1.output_token_ids == reference(short, 12)
    assert s2.output_token_ids == reference(long, 5)


def test_max_num_seqs_limits_running(llama_dir, reference):
    engine = make_engine(llama_dir, num_blocks=32, max_num_seqs=2)
    steps = record_steps(engine)
    prompts = [prompt(8, 60 + i) for i in range(4)]
    seqs = [engine.add_request(EngineRequest(f"q{i}", p, SamplingParams(max_tokens=4, **GREEDY)))
            for i, p in enumerate(prompts)]
    run_all(engine)
    assert max(len(step) for step in steps) == 2
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == reference(p, 4)


def test_preemption_under_memory_pressure_keeps_greedy_outputs(llama_dir, reference):
    # 6 blocks of 16 tokens; each request needs 20 + 40 tokens = 4 blocks: one fits alone,
    # three cannot run together.
    engine = make_engine(llama_dir, num_blocks=6)
    prompts = [prompt(20, 80 + i) for i in range(3)]
    seqs = [engine.add_request(EngineRequest(f"m{i}", p, SamplingParams(max_tokens=40, **GREEDY)))
            for i, p in enumerate(prompts)]
    run_all(engine)
    assert sum(s.num_preemptions for s in seqs) > 0
    for p, s in zip(prompts, seqs):
        assert s.finish_reason == "length"
        assert s.output_token_ids == reference(p, 40)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert all(b.ref_count == 0 for b in engine.kv.pool.blocks)


def test_preemption_with_chunked_prefill_and_seeded_sampling(llama_dir):
    """Seeded sampling survives preemption: the generator continues where it was."""
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=7, ignore_eos=True)
    solo_engine = make_engine(llama_dir, num_blocks=64)
    prompts = [prompt(24, 90 + i) for i in range(3)]
    solo = [solo_engine.generate(p, params).output_token_ids for p in prompts]
    engine = make_engine(llama_dir, num_blocks=5, max_num_batched_tokens=16)
    seqs = [engine.add_request(EngineRequest(f"s{i}", p, params)) for i, p in enumerate(prompts)]
    run_all(engine)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert [s.output_token_ids for s in seqs] == solo


def test_request_that_can_never_fit_raises_capacity_error(llama_dir):
    engine = make_engine(llama_dir, num_blocks=6)  # 96 tokens of KV
    with pytest.raises(CapacityError) as err:
        engine.add_request(EngineRequest("big", prompt(20, 1), SamplingParams(max_tokens=100)))
    assert err.value.code == "kv_budget_exceeded"
    assert err.value.param == "max_tokens"
    with pytest.raises(CapacityError):  # no max_tokens and a prompt larger than the whole cache
        engine.add_request(EngineRequest("big2", prompt(120, 2), SamplingParams()))
    assert not engine.has_work
    # what fits exactly is accepted
    seq = engine.add_request(EngineRequest("fits", prompt(20, 3), SamplingParams(max_tokens=76, **GREEDY)))
    run_all(engine)
    assert len(seq.output_token_ids) == 76


def test_default_max_tokens_is_bounded_by_kv_and_context(llama_dir):
    engine = make_engine(llama_dir, num_blocks=4)  # 64 tokens of KV, context 512
    seq = engine.add_request(EngineRequest("d", prompt(20, 4), SamplingParams(**GREEDY)))
    assert seq.max_tokens == 44
    engine2 = make_engine(llama_dir, num_blocks=32, max_model_len=48)
    seq2 = engine2.add_request(EngineRequest("d", prompt(20, 4), SamplingParams(**GREEDY)))
    assert seq2.max_tokens == 28
    run_all(engine2)
    assert len(seq2.output_token_ids) == 28
    assert seq2.finish_reason == "length"


def test_context_length_errors(llama_dir):
    engine = make_engine(llama_dir, num_blocks=64, max_model_len=64)
    assert engine.max_model_len == 64
    with pytest.raises(ContextLengthError) as err:
        engine.add_request(EngineRequest("long", prompt(64, 1), SamplingParams(max_tokens=1)))
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthError):
        engine.add_request(EngineRequest("long2", prompt(100, 1), SamplingParams()))
    with pytest.raises(ContextLengthError):
        engine.add_request(EngineRequest("sum", prompt(40, 1), SamplingParams(max_tokens=25)))
    engine.add_request(EngineRequest("ok", prompt(40, 1), SamplingParams(max_tokens=24)))
    # max_model_len beyond the model's positions is clamped to them
    assert make_engine(llama_dir, num_blocks=8, max_model_len=4096).max_model_len == 512


def test_invalid_prompts(llama_dir):
    engine = make_engine(llama_dir, num_blocks=8)
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineRequest("e", [], SamplingParams()))
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineRequest("v", [1, vocab], SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineRequest("n", [1, -1], SamplingParams(max_tokens=2)))
    assert not engine.has_work


def test_abort_frees_all_blocks(llama_dir):
    engine = make_engine(llama_dir, num_blocks=16, tiers=NO_LOWER_TIER)
    pool = engine.kv.pool
    a = engine.add_request(EngineRequest("a", prompt(30, 1), SamplingParams(max_tokens=50, **GREEDY)))
    b = engine.add_request(EngineRequest("b", prompt(45, 2), SamplingParams(max_tokens=50, **GREEDY)))
    for _ in range(5):
        engine.step()
    assert pool.num_free < pool.num_blocks
    assert engine.abort("a")
    assert a.is_finished and a.finish_reason == "abort"
    assert not engine.abort("a")
    assert not engine.abort("nope")
    assert engine.abort("b")
    assert not engine.has_work
    assert pool.num_free == pool.num_blocks
    assert all(blk.ref_count == 0 for blk in pool.blocks)
    assert b.blocks == []


def test_abort_waiting_and_mid_prefill_requests(llama_dir):
    engine = make_engine(llama_dir, num_blocks=16, max_num_batched_tokens=8, max_num_seqs=1)
    pool = engine.kv.pool
    a = engine.add_request(EngineRequest("a", prompt(30, 1), SamplingParams(max_tokens=5, **GREEDY)))
    w = engine.add_request(EngineRequest("w", prompt(10, 2), SamplingParams(max_tokens=5, **GREEDY)))
    engine.step()  # a: first prefill chunk; w waits
    assert 0 < a.num_computed_tokens < 30
    assert engine.abort("w")
    assert engine.abort("a")
    assert not engine.has_work
    assert pool.num_free == pool.num_blocks
    assert w.finish_reason == "abort"
    assert engine.step() == []


def test_prefix_cache_hit_and_eviction_accounting(llama_dir):
    engine = make_engine(llama_dir, num_blocks=16)
    ids = prompt(40, 3)
    params = SamplingParams(max_tokens=3, **GREEDY)
    first = engine.generate(ids, params)
    second = engine.generate(ids, params)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert second.output_token_ids == first.output_token_ids
    # a different prompt sharing the first 16 tokens hits one block
    third = engine.generate(ids[:16] + prompt(10, 9), params)
    assert third.num_cached_tokens == 16
    assert engine.kv.num_hit_tokens == 48


def test_stop_token_ids_and_eos(llama_dir):
    engine = make_engine(llama_dir, num_blocks=16)
    ids = prompt(12, 11)
    free_run = engine.generate(ids, SamplingParams(max_tokens=10, **GREEDY)).output_token_ids
    stop_at = free_run[3]
    first = free_run.index(stop_at)
    seq = engine.generate(ids, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_at,)))
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == free_run[: first + 1]
    # EOS ends a request unless ignore_eos is set
    engine.eos_token_ids = frozenset({free_run[1]})
    seq = engine.generate(ids, SamplingParams(max_tokens=10, temperature=0.0))
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == free_run[: free_run.index(free_run[1]) + 1]
    seq = engine.generate(ids, SamplingParams(max_tokens=10, **GREEDY))
    assert seq.output_token_ids == free_run


def test_engine_eos_ids_come_from_config_and_tokenizer(llama_dir):
    engine = make_engine(llama_dir, num_blocks=8)
    assert engine.tokenizer.token_id("<|im_end|>") in engine.eos_token_ids
    assert engine.model_config.eos_token_ids == (engine.tokenizer.token_id("<|im_end|>"),)


@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_block_size_does_not_change_outputs(llama_dir, reference, block_size):
    engine = make_engine(llama_dir, num_blocks=48 * 16 // block_size, block_size=block_size,
                         max_num_batched_tokens=24)
    prompts = [prompt(n, 120 + n) for n in (5, 23, 40)]
    seqs = [engine.add_request(EngineRequest(f"b{i}", p, SamplingParams(max_tokens=9, **GREEDY))) for i, p in enumerate(prompts)]
    run_all(engine)
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == reference(p, 9)
    again = engine.generate(prompts[2], SamplingParams(max_tokens=9, **GREEDY))
    assert again.num_cached_tokens == (40 - 1) // block_size * block_size
    assert again.output_token_ids == reference(prompts[2], 9)


def test_background_work_runs_in_capped_chunks_only_in_steps_no_request_wants(llama_dir, reference):
    """A background sequence (a fidelity probe's score) pauses, KV kept, while a request
    waits or runs, takes no `max_num_seqs` slot, and resumes where it stopped."""
    engine = make_engine(llama_dir, num_blocks=32, max_num_seqs=1, tiers=NO_LOWER_TIER, probe_idle_ms=0.0)
    steps = record_steps(engine)
    bg_ids, a_ids = prompt(50, 7), prompt(20, 8)
    bg = engine.add_request(EngineRequest("bg", bg_ids, SamplingParams(max_tokens=2, **GREEDY), publish=False,
                                          background=True, max_chunk_tokens=16))
    engine.step()
    a = engine.add_request(EngineRequest("a", a_ids, SamplingParams(max_tokens=3, **GREEDY)))
    assert engine.scheduler.find("bg") is bg
    run_all(engine)
    assert steps == [[("bg", 16)], [("a", 20)], [("a", 1)], [("a", 1)],
                     [("bg", 16)], [("bg", 16)], [("bg", 2)], [("bg", 1)]]
    assert a.output_token_ids == reference(a_ids, 3) and bg.output_token_ids == reference(bg_ids, 2)
    assert bg.num_preemptions == 0 and engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert engine.kv.pool.num_cached == 1  # a's one full block; the background one published nothing


def test_background_work_is_aborted_like_a_request(llama_dir):
    engine = make_engine(llama_dir, num_blocks=32, tiers=NO_LOWER_TIER)
    engine.add_request(EngineRequest("bg", prompt(50, 9), SamplingParams(max_tokens=2, **GREEDY), publish=False,
                                     background=True, max_chunk_tokens=16))
    engine.step()
    assert engine.abort("bg") and not engine.has_work
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineRequest("bad", prompt(5, 1), SamplingParams(max_tokens=2), max_chunk_tokens=0))
