"""Fidelity probes (engine_ext/probes.py): a probed approximate request is scored again
densely on spare capacity, without changing its answer, and a failing probe never
stops the engine loop."""

from __future__ import annotations

import pytest
import torch

import engine_ext.probes as probes_mod
from engine_ext.async_engine import AsyncEngine
from engine_ext.engine import LLMEngine
from engine_ext.probes import ProbeJob, Probes
from engine_ext.reuse.segments import ReuseScope, SegmentOutcome, TokenSegment
from engine_ext.sampling import SamplingParams
from tests.helpers import make_engine, wait_until
from engine_ext.request import EngineRequest

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SCOPE = ReuseScope("travel", "critic", tenant="acme")
DOC = "the capital of France is Paris and the river is wide.\n"


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
    assert wait_until(lambda: not llm.has_work)
    assert llm.kv.pool.num_free == llm.kv.pool.num_blocks  # the dense score left nothing behind


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


def _job(llm: LLMEngine, rid: str = "r") -> ProbeJob:
    prompt = llm.tokenizer.encode("Water boils at a hundred degrees")
    approx = llm.generate(prompt, GREEDY, record_logits=True)
    return ProbeJob(rid, "t", "app", "shift", prompt, approx.output_token_ids, torch.stack(approx.logits))


def test_a_running_probe_yields_to_requests_and_resumes_when_idle(llama_dir):
    llm = make_engine(llama_dir, num_blocks=64)
    probes = Probes()
    probes._jobs.append(_job(llm))
    probes.tick(llm, busy=False)
    llm.step()
    probes.after_step()
    probes.tick(llm, busy=True)  # a request arrived: the probe is aborted and queued again
    # No request is left (a KV backup to the host tier may still be in flight: has_work counts it too).
    assert probes.num_interrupted == 1 and not llm.scheduler.has_work and probes.has_jobs
    probes.tick(llm, busy=False)
    while llm.has_work:
        llm.step()
        probes.after_step()
    (result,), _ = probes.results_after(0)
    assert result.top1 == 1.0 and result.kl < 1e-4  # dense against dense: identical
    assert not probes.has_jobs


def _drain(llm: LLMEngine, probes: Probes) -> None:
    while probes.has_jobs:
        probes.tick(llm, busy=False)
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
