"""Fidelity probes (engine_ext/probes.py): a probed approximate request is scored again
densely on spare capacity, without changing its answer, and a failing probe never
stops the engine loop."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

import engine_ext.async_engine as async_engine_mod
import engine_ext.probes as probes_mod
import engine_ext.scheduler as scheduler_mod
from engine_ext.async_engine import AsyncEngine
from engine_ext.config import TierConfig
from engine_ext.engine import LLMEngine
from engine_ext.fidelity import compare_logits
from engine_ext.probes import ProbeJob, Probes
from engine_ext.reuse.segments import ReuseScope, SegmentOutcome, TokenSegment
from engine_ext.sampling import SamplingParams
from engine_ext.scheduler import SchedulerOutput
from tests.helpers import make_engine, wait_until
from engine_ext.request import EngineRequest

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SCOPE = ReuseScope("travel", "critic", tenant="acme")
DOC = "the capital of France is Paris and the river is wide.\n"
# No lower KV tier: these tests count steps and free blocks, and a write-through backup
# keeps its block pinned (and the engine stepping) until the copy lands.
NO_LOWER_TIER = TierConfig(host_bytes=0)


def _shifted(llm: LLMEngine) -> tuple[list[int], list[TokenSegment]]:
    """A prompt whose document segment is placed with `shift` (its KV was computed
    without the head), after priming the segment index with the document alone."""
    tok = llm.tokenizer
    head, doc = tok.encode("the plan of the day:\n"), tok.encode(DOC)
    llm.generate(doc, SamplingParams(max_tokens=1), segments=[TokenSegment(0, len(doc), "shared_block", None, "shift")],
                 publish=False, scope=SCOPE)
    prompt = head + doc + tok.encode("why?")
    return prompt, [TokenSegment(len(head), len(head) + len(doc), "shared_block", None, "shift")]


@pytest.fixture
def served(llama_dir):
    """An engine thread with probes, and the shifted prompt (primed before the thread
    starts: only the engine thread may step the engine once it runs)."""
    llm = make_engine(llama_dir, num_blocks=64)
    shifted = _shifted(llm)
    eng = AsyncEngine(llm, Probes(max_tokens=6))
    eng.start()
    yield llm, eng, shifted
    eng.stop()


async def _run(eng: AsyncEngine, rid: str, prompt: list[int], segments: list[TokenSegment] | None,
               probe: bool) -> list[int]:
    return [t async for o in eng.generate(EngineRequest(rid, prompt, GREEDY, segments=segments, scope=SCOPE, probe=probe))
            for t in o.new_token_ids]


async def test_a_probed_shift_request_is_scored_densely_and_answers_the_same(served):
    llm, eng, (prompt, segments) = served
    plain = await _run(eng, "plain", prompt, segments, probe=False)
    probed = await _run(eng, "probed", prompt, segments, probe=True)
    assert probed == plain  # recording logits and re-scoring never change the answer
    assert wait_until(lambda: eng.probes.results_after(0)[0], timeout=10)
    (result,), next_seq = eng.probes.results_after(0)
    assert (result.request_id, result.tenant, result.app, result.method) == ("probed", "acme", "travel", "shift")
    assert result.tokens == 6 and next_seq == result.seq == 1  # capped at max_tokens
    assert 0.0 <= result.top1 <= 1.0 and result.kl > 1e-4  # shift placed KV computed without the head
    assert eng.probes.results_after(1) == ([], 1)
    counters = eng.probes.counters()
    assert counters["chunks"] >= 1 and counters["preempted"] == counters["failed"] == 0
    assert wait_until(lambda: not llm.has_work)
    assert llm.kv.pool.num_free == llm.kv.pool.num_blocks  # the dense score left nothing behind


async def test_a_score_stays_pending_until_its_result_can_be_read(served, monkeypatch):
    """`has_pending` is what a reader waits on before it reads the results: while a
    finished score is being turned into its result, it must still say one may come
    (else a reader sees no pending score and no result, and stops waiting)."""
    llm, eng, (prompt, segments) = served
    seen: list[tuple[bool, int]] = []

    def compare(dense: torch.Tensor, probed: torch.Tensor) -> tuple[float, float]:
        seen.append((eng.probes.has_pending, len(eng.probes.results_after(0)[0])))
        return compare_logits(dense, probed)

    monkeypatch.setattr(probes_mod, "compare_logits", compare)
    await _run(eng, "probed", prompt, segments, probe=True)
    assert wait_until(lambda: eng.probes.results_after(0)[0], timeout=10)
    assert seen == [(True, 0)]
    assert wait_until(lambda: not eng.probes.has_pending, timeout=10)


async def test_exact_or_unprobed_requests_queue_nothing(served):
    llm, eng, (prompt, segments) = served
    await _run(eng, "unprobed", prompt, segments, probe=False)
    await _run(eng, "exact", prompt, [TokenSegment(s.start, s.end, s.kind) for s in segments], probe=True)
    assert eng.probes.num_skipped == 1 and not eng.probes.has_jobs
    assert eng.probes.results_after(0) == ([], 0)


async def test_a_failing_probe_is_logged_and_the_loop_goes_on(served, monkeypatch, caplog):
    llm, eng, (prompt, segments) = served

    def broken(dense: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
        raise RuntimeError("boom")

    monkeypatch.setattr(probes_mod, "compare_logits", broken)
    first = await _run(eng, "one", prompt, segments, probe=True)
    assert wait_until(lambda: eng.probes.num_failed == 1, timeout=10)
    assert "fidelity probe of request one failed" in caplog.text
    monkeypatch.undo()
    assert eng.is_alive
    assert await _run(eng, "two", prompt, segments, probe=True) == first
    assert wait_until(lambda: eng.probes.results_after(0)[0], timeout=10)
    assert [r.request_id for r in eng.probes.results_after(0)[0]] == ["two"]


def _job(llm: LLMEngine, rid: str = "r", prompt: list[int] | None = None, max_tokens: int = 8) -> ProbeJob:
    """A job whose 'approximate' logits are the engine's own (a dense score finds top-1 1.0)."""
    prompt = prompt if prompt is not None else llm.tokenizer.encode("Water boils at a hundred degrees")
    approx = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          record_logits=True)
    return ProbeJob(rid, "t", "app", "shift", prompt, approx.output_token_ids, torch.stack(approx.logits))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _record_steps(llm: LLMEngine) -> list[list[tuple[str, int]]]:
    """Every step's chunks, as (request_id, tokens computed)."""
    steps: list[list[tuple[str, int]]] = []
    schedule = llm.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        steps.append([(c.seq.request_id, c.num_tokens) for c in out.chunks])
        return out

    llm.scheduler.schedule = spy  # type: ignore[method-assign]
    return steps


def _step(llm: LLMEngine, probes: Probes) -> None:
    probes.tick(llm)
    llm.step()
    probes.after_step()


def test_a_probe_delays_an_arriving_request_by_one_chunk_step_and_resumes_where_it_paused(llama_dir):
    llm = make_engine(llama_dir, num_blocks=64, tiers=NO_LOWER_TIER, probe_idle_ms=0.0)  # steps counted: no grace
    job = _job(llm, prompt=_ids(100, 1), max_tokens=6)
    llm.kv.pool.reset_cache()  # no prefix hit: the probe computes every token itself
    probes = Probes(chunk_tokens=16)
    probes._jobs.append(job)
    steps = _record_steps(llm)
    _step(llm, probes)
    _step(llm, probes)
    assert steps == [[("probe-r", 16)], [("probe-r", 16)]]  # a chunk a step, alone
    dense = probes._running.seq
    # A request arrives mid-prefill: it runs at the very next step, and alone until it ends.
    real = llm.add_request(EngineRequest("real", _ids(40, 2), GREEDY))
    while not real.is_finished:
        _step(llm, probes)
    request_steps = steps[2:]
    assert request_steps[0] == [("real", 40)]
    assert all(ids == [("real", 1)] for ids in request_steps[1:]) and len(request_steps) == GREEDY.max_tokens
    assert dense.num_computed_tokens == 32 and dense.blocks  # paused, its KV and progress kept
    assert probes.num_paused == 1 and probes.num_preempted == 0
    assert probes.counters()["running"] == 1 and probes.counters()["queued"] == 0  # what the bench waits on
    while probes.has_jobs:
        _step(llm, probes)
    probe_steps = [chunk for step in steps[2 + len(request_steps):] for chunk in step]
    assert probe_steps[0] == ("probe-r", 16)  # resumed at token 32, not from the start
    assert all(rid == "probe-r" and n <= 16 for rid, n in probe_steps)
    # Every token of the prompt and the forced answer (but its last) computed once, in all.
    assert sum(n for step in steps for rid, n in step if rid == "probe-r") == 100 + 6 - 1
    (result,), _ = probes.results_after(0)
    assert result.top1 == 1.0 and result.kl < 1e-4 and result.tokens == 6  # dense against dense
    counters = probes.counters()
    assert counters["chunks"] == -(-105 // 16) and counters["paused"] == 1 and counters["preempted"] == 0
    assert counters["running"] == counters["queued"] == 0
    assert llm.kv.pool.num_free == llm.kv.pool.num_blocks  # the score left nothing behind


def test_a_probe_waits_until_no_request_has_run_for_the_idle_grace(llama_dir, monkeypatch):
    """In an agent chain the next request follows the last answer within milliseconds: a
    probe chunk started in that gap would hold it, so none starts before the grace."""
    now = [1000.0]
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(monotonic=lambda: now[0]))
    llm = make_engine(llama_dir, num_blocks=64, tiers=NO_LOWER_TIER, probe_idle_ms=50.0)
    probes = Probes(chunk_tokens=16)
    probes._jobs.append(_job(llm, prompt=_ids(40, 3), max_tokens=2))
    steps = _record_steps(llm)
    real = llm.add_request(EngineRequest("real", _ids(20, 4), GREEDY))
    while not real.is_finished:
        _step(llm, probes)
    del steps[:]
    now[0] += 0.049
    _step(llm, probes)
    assert steps == [[]] and probes._running.seq.num_computed_tokens == 0  # within the grace: nothing
    now[0] += 0.002
    _step(llm, probes)
    assert steps[-1] == [("probe-r", 16)]


async def test_the_engine_thread_sleeps_through_the_idle_window_and_an_arrival_wakes_it(llama_dir):
    """A probe waiting for `probe_idle_ms` without requests: the engine thread sleeps until
    the window ends (no empty steps on the cores the next request needs), then scores; a
    request arriving meanwhile is served at once, and the window starts again after it."""
    llm = make_engine(llama_dir, num_blocks=64, tiers=NO_LOWER_TIER, probe_idle_ms=400.0)
    job = _job(llm, prompt=_ids(40, 7), max_tokens=2)  # before the thread: only it may step the engine
    eng = AsyncEngine(llm, Probes(chunk_tokens=16))
    steps = _record_steps(llm)
    eng.start()
    try:
        await _run(eng, "first", _ids(20, 8), None, probe=False)
        del steps[:]
        eng.probes._jobs.append(job)
        eng._commands.put(async_engine_mod._Wake())  # the thread notices the job at once
        await asyncio.sleep(0.25)
        assert 1 <= len(steps) <= 3 and not any(steps)  # asleep in the window, not stepping at ~1 kHz
        asked = time.monotonic()
        await _run(eng, "second", _ids(20, 9), None, probe=False)
        assert time.monotonic() - asked < 0.3  # the arrival woke it: it did not wait out the window
        after = len(steps)
        assert wait_until(lambda: eng.probes.results_after(0)[0], timeout=10)
        assert steps[after:].count([]) <= 3 and any(("probe-r", 16) in step for step in steps[after:])
    finally:
        eng.stop()


def test_an_arrival_stops_a_probe_chunk_between_layers_and_the_chunk_runs_again(llama_dir):
    """A request arriving while a probe's chunk computes waits one layer, not the chunk:
    the step stops before its next layer, nothing advances, and the chunk is computed
    again later; the finished score is still the dense one."""
    llm = make_engine(llama_dir, num_blocks=64, tiers=NO_LOWER_TIER, probe_idle_ms=0.0)
    prompt = _ids(40, 5)
    job = _job(llm, prompt=prompt, max_tokens=4)
    dense_logits = llm.score(prompt, job.output_ids, publish=False).logits
    llm.kv.pool.reset_cache()
    probes = Probes(chunk_tokens=16)
    probes._jobs.append(job)
    probes.tick(llm)
    dense = probes._running.seq
    asked: list[int] = []

    def arrival_after_layer_0() -> bool:  # the model asks before every layer but the first
        asked.append(1)
        return True

    assert llm.step(interrupt=arrival_after_layer_0) == [] and len(asked) == 1
    probes.after_step()
    assert dense.num_computed_tokens == 0 and llm.num_interrupted_steps == 1  # nothing advanced
    real = llm.add_request(EngineRequest("real", _ids(20, 6), GREEDY))
    llm.step(interrupt=lambda: True)  # a request's step is never interrupted
    assert real.num_computed_tokens == 20 and llm.num_interrupted_steps == 1
    while not real.is_finished:
        _step(llm, probes)
    while probes.has_jobs:
        _step(llm, probes)
    (result,), _ = probes.results_after(0)
    assert torch.allclose(torch.stack(dense.logits), dense_logits, atol=1e-4)
    assert result.top1 == 1.0 and result.kl < 1e-4


def test_a_landed_transfer_does_not_stop_a_probe_but_a_command_behind_it_does(llama_dir):
    """The transfer thread rings the engine thread's queue as each KV copy lands: not an
    arrival, so a probe's chunk goes on; a request, abort or stop queued behind it still
    stops the chunk, and is applied next, in order."""
    llm = make_engine(llama_dir, num_blocks=64, tiers=NO_LOWER_TIER)
    eng = AsyncEngine(llm)
    wake = async_engine_mod._Wake
    eng._commands.put(wake())
    eng._commands.put(wake())
    assert not eng._commands_waiting() and eng._commands.empty()  # dropped, remembered
    assert eng._woken
    eng._commands.put(wake())
    eng._commands.put(async_engine_mod._Abort("gone"))
    eng._commands.put(None)
    assert eng._commands_waiting() and eng._commands_waiting()  # asked again: still waiting
    assert eng._drain_commands(0.0) is False  # the abort, then the stop: nothing lost
    assert eng._commands.empty()


@pytest.mark.parametrize("chunk_tokens", [1, 20, 64])
def test_the_chunked_score_equals_the_whole_prompt_dense_score(llama_dir, chunk_tokens):
    """Prompt and forced answer prefilled in chunks (at 1, token by token; at 20, the
    positions scored straddle two chunks) give the logits of a whole-prompt prefill and
    forced decode steps, so the same top-1 agreement and KL."""
    llm = make_engine(llama_dir, num_blocks=64, tiers=NO_LOWER_TIER)
    prompt = _ids(40, 3)
    exact = _job(llm, prompt=prompt, max_tokens=8)
    noise = torch.randn(exact.logits.shape, generator=torch.Generator().manual_seed(0))
    job = exact._replace(logits=exact.logits + 2.0 * noise)  # 'approximate': top-1 and KL off
    old = llm.score(prompt, job.output_ids, publish=False).logits  # the whole-prompt score, as before
    llm.kv.pool.reset_cache()
    probes = Probes(chunk_tokens=chunk_tokens)
    probes._jobs.append(job)
    probes.tick(llm)
    dense = probes._running.seq
    while probes.has_jobs:
        _step(llm, probes)
    (result,), _ = probes.results_after(0)
    assert torch.allclose(torch.stack(dense.logits), old, atol=1e-4)
    top1, kl = compare_logits(old, job.logits)
    assert result.top1 == top1 < 1.0 and result.kl == pytest.approx(kl, rel=1e-4) and kl > 1e-3


def test_memory_pressure_frees_the_probe_never_the_request(llama_dir):
    llm = make_engine(llama_dir, num_blocks=8, tiers=NO_LOWER_TIER, probe_idle_ms=0.0)  # 128 tokens of KV
    job = _job(llm, prompt=_ids(80, 4), max_tokens=6)
    question = _ids(90, 5)
    alone = llm.generate(question, GREEDY).output_token_ids
    llm.kv.pool.reset_cache()
    probes = Probes(chunk_tokens=16)
    probes._jobs.append(job)
    for _ in range(3):
        _step(llm, probes)
    dense = probes._running.seq
    assert dense.num_computed_tokens == 48 and len(dense.blocks) == 3
    real = llm.add_request(EngineRequest("real", question, GREEDY))  # needs 7 of the 8 blocks
    while not real.is_finished:
        _step(llm, probes)
    assert real.num_preemptions == 0 and real.output_token_ids == alone
    assert dense.num_preemptions == 1 and probes.num_preempted == 1 and probes.num_paused == 0
    while probes.has_jobs:  # it starts over once the request is done, and still scores
        _step(llm, probes)
    (result,), _ = probes.results_after(0)
    assert result.top1 == 1.0 and result.kl < 1e-4


def test_a_probe_that_cannot_start_is_dropped_and_counted(llama_dir, caplog):
    llm = make_engine(llama_dir, num_blocks=64)
    probes = Probes()
    job = _job(llm)
    probes._jobs.append(job._replace(prompt_ids=[10**6]))  # outside the vocabulary: refused
    probes._jobs.append(job)
    _drain(llm, probes)
    assert probes.num_failed == 1 and "could not start" in caplog.text
    assert [r.request_id for r in probes.results_after(0)[0]] == ["r"]


def _drain(llm: LLMEngine, probes: Probes) -> None:
    while probes.has_jobs:
        probes.tick(llm)
        if llm.has_work:
            llm.step()
        probes.after_step()


def test_queues_and_results_are_bounded(llama_dir):
    llm = make_engine(llama_dir, num_blocks=64)
    probes = Probes(max_jobs=2, max_results=2)
    prompt = llm.tokenizer.encode("Water boils at a hundred degrees")
    for rid in ("a", "b", "c"):
        seq = llm.add_request(EngineRequest(rid, prompt, GREEDY, segments=[TokenSegment(0, 4, "shared_block", None, "shift")]))
        probes.watch(seq)
        while not seq.is_finished:
            llm.step()
        seq.reuse_outcomes = [SegmentOutcome(seq.segments[0], "shift", 4, 0)]  # as if placed
        probes.finished(rid)
    assert probes.num_dropped == 1 and [j.request_id for j in probes._jobs] == ["b", "c"]
    _drain(llm, probes)
    probes._jobs.append(_job(llm, "d"))
    _drain(llm, probes)
    results, next_seq = probes.results_after(0)
    assert [(r.seq, r.request_id) for r in results] == [(2, "c"), (3, "d")] and next_seq == 3
    assert probes.results_after(3) == ([], 3)
