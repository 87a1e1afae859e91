"""AsyncEngine: the engine thread, result streaming into asyncio, aborts on early exit."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_ext.async_engine import AsyncEngine
from engine_ext.errors import CapacityError, EngineDeadError
from engine_ext.request import EngineRequest
from engine_ext.sampling import SamplingParams
from engine_ext.timeline import TTFT_STAGES, Timeline
from tests.helpers import make_engine, wait_until

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engines(llama_dir):
    llm = make_engine(llama_dir, num_blocks=16)
    llm.aborted = []
    abort = llm.abort

    def spy_abort(request_id):
        llm.aborted.append(request_id)
        return abort(request_id)

    llm.abort = spy_abort
    eng = AsyncEngine(llm)
    eng.start()
    yield llm, eng
    eng.stop()
    assert not eng.is_alive


async def test_generate_streams_until_finished(engines, llama_dir):
    llm, eng = engines
    ids = llm.tokenizer.encode("The quick brown fox")
    outs = [o async for o in eng.generate(EngineRequest("a", ids, GREEDY))]
    assert len(outs) == 10
    assert [o.finished for o in outs] == [False] * 9 + [True]
    assert outs[-1].finish_reason == "length"
    assert [o.num_output_tokens for o in outs] == list(range(1, 11))
    tokens = [t for o in outs for t in o.new_token_ids]
    ref = make_engine(llama_dir, num_blocks=16).generate(ids, GREEDY)
    assert tokens == ref.output_token_ids
    assert "".join(o.delta_text for o in outs) == ref.detokenizer.text


def test_a_callers_loop_closing_mid_stream_aborts_its_request_and_the_engine_serves_on(engines):
    """A caller's event loop closed while its request streams (its generator never
    finalised, so no abort was sent): the engine thread finds the loop closed when it
    delivers the next output, aborts the request and goes on serving."""
    llm, eng = engines
    ids = llm.tokenizer.encode("The quick brown fox")
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    loop = asyncio.new_event_loop()
    stream = eng.generate(EngineRequest("orphan", ids, long))
    first = loop.run_until_complete(stream.__anext__())
    assert not first.finished
    loop.close()  # the generator is left suspended: nobody will read or abort it
    assert wait_until(lambda: "orphan" in llm.aborted, timeout=30)
    assert eng.is_alive

    async def next_request() -> list[int]:
        return [t async for o in eng.generate(EngineRequest("next", ids, GREEDY)) for t in o.new_token_ids]

    assert len(asyncio.run(next_request())) == GREEDY.max_tokens
    assert eng.is_alive


async def test_concurrent_generations(engines):
    llm, eng = engines
    prompts = [llm.tokenizer.encode(t) for t in ("Alice met Bob", "Water boils", "Good morning")]

    async def run(i, ids):
        return [t async for o in eng.generate(EngineRequest(f"c{i}", ids, GREEDY)) for t in o.new_token_ids]

    together = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    alone = [await run(10 + i, p) for i, p in enumerate(prompts)]
    assert together == alone


async def test_validation_error_is_raised_on_first_iteration(engines):
    llm, eng = engines
    gen = eng.generate(EngineRequest("big", [5] * 10, SamplingParams(max_tokens=400)))
    with pytest.raises(CapacityError):
        await anext(gen)
    assert not llm.has_work
    assert llm.aborted == []  # a refused request has nothing to abort


async def test_leaving_early_aborts_and_frees(engines):
    llm, eng = engines
    gen = eng.generate(EngineRequest("long", [5] * 10, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)))
    first = await anext(gen)
    assert not first.finished
    await gen.aclose()
    assert await asyncio.to_thread(wait_until, lambda: not llm.has_work and
                                   llm.kv.pool.num_free == llm.kv.pool.num_blocks)
    assert llm.aborted == ["long"]
    assert eng._sinks == {}


async def test_cancelled_consumer_aborts(engines):
    llm, eng = engines

    async def consume():
        async for _ in eng.generate(EngineRequest("cancel-me", [5] * 10,
                                    SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))):
            await asyncio.sleep(0.01)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(wait_until, lambda: not llm.has_work and
                                   llm.kv.pool.num_free == llm.kv.pool.num_blocks)
    assert llm.aborted == ["cancel-me"]


async def test_not_started_or_stopped_engine_is_dead(llama_dir):
    eng = AsyncEngine(make_engine(llama_dir, num_blocks=8))
    with pytest.raises(EngineDeadError):
        await anext(eng.generate(EngineRequest("x", [5], GREEDY)))
    eng.start()
    assert eng.is_alive
    eng.stop()
    with pytest.raises(EngineDeadError):
        await anext(eng.generate(EngineRequest("x", [5], GREEDY)))


async def test_stop_fails_requests_in_flight(llama_dir):
    llm = make_engine(llama_dir, num_blocks=16)
    eng = AsyncEngine(llm)
    eng.start()
    step = llm.step

    def slow_step(interrupt=None):
        import time

        time.sleep(0.01)
        return step(interrupt)

    llm.step = slow_step
    gen = eng.generate(EngineRequest("inflight", [5] * 10, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)))
    await anext(gen)
    await asyncio.to_thread(eng.stop)
    with pytest.raises(EngineDeadError):
        async for _ in gen:
            pass
    assert llm.kv.pool.num_free == llm.kv.pool.num_blocks


async def test_the_callers_timeline_is_prepare_until_handed_over_then_queue(engines):
    llm, eng = engines
    ids = llm.tokenizer.encode("The quick brown fox")
    line = Timeline(arrived=time.monotonic() - 0.25)  # the caller began a quarter second ago
    outs = [o async for o in eng.generate(EngineRequest("t", ids, GREEDY), timeline=line)]
    assert outs[-1].timeline is line and line.finished is not None
    stages = line.stages()
    assert list(stages) == ["prepare", "queue", "plan", "prefill", "first", "decode"]
    assert stages["prepare"].seconds >= 0.25 and stages["queue"].start == line.queued
    assert sum(stages[name].seconds for name in TTFT_STAGES) == pytest.approx(line.ttft)


async def test_an_aborted_request_leaves_its_timeline_finished(engines):
    llm, eng = engines
    line = Timeline()
    outputs = eng.generate(EngineRequest("gone", llm.tokenizer.encode("Tell me a story"), GREEDY), timeline=line)
    await anext(outputs)
    await outputs.aclose()  # the caller walks away after its first token
    assert wait_until(lambda: line.finished is not None)
    assert line.first_token is not None and line.finished >= line.first_token


def test_build_off_thread_builds_on_a_thread_that_has_ended_and_reraises_its_error():
    import threading

    import pytest

    from engine_ext.async_engine import build_off_thread

    built_on: list[threading.Thread] = []
    assert build_off_thread(lambda: built_on.append(threading.current_thread()) or 7) == 7
    assert built_on[0] is not threading.current_thread() and not built_on[0].is_alive()
    with pytest.raises(ValueError, match="no model"):
        build_off_thread(lambda: (_ for _ in ()).throw(ValueError("no model")))


def test_the_serving_layer_reads_the_model_s_facts_and_counters_as_values(engines):
    """The service reads `AsyncEngine.model` and `reuse_counters()`, never the engine's parts:
    the facts are the loaded model's, and the counters a snapshot of what reuse did."""
    llm, eng = engines
    model = eng.model
    assert (model.name, model.vocab_size, model.max_model_len, model.block_size) == (
        llm.model_name, llm.model_config.vocab_size, llm.max_model_len, llm.config.block_size)
    assert model.tokenizer is llm.tokenizer and model.eos_token_ids == llm.eos_token_ids
    assert model.adapter_names == ()
    counters = eng.reuse_counters()
    assert counters.interrupted_steps == llm.num_interrupted_steps == 0
    assert counters.collective == (0, 0)  # collective reuse is on by default, and nothing ran yet
