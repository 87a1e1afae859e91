"""The engine with lower KV tiers: prefetch before dispatch, status-aware admission, reactive loads, failures."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import engine_ext.tiers.store as store_module
from engine_ext.async_engine import AsyncEngine
from engine_ext.config import ReuseConfig, TierConfig
from engine_ext.engine import LLMEngine
from kvrelay.wire.plan import WorkflowInfo
from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.sampling import SamplingParams
from engine_ext.sequence import Sequence, SequenceStatus
from tests.engine_ext.tiers import ring
from tests.helpers import TINY_BLOCK_BYTES, make_engine, wait_until
from engine_ext.request import EngineRequest

BS = 16
AGENTS = ("planner", "coder", "tester", "reviewer")
FIXED_TOKENS = (64, 80, 96, 112)  # 4 to 7 blocks each: 22 blocks in all
SAMPLING = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _fixed(agent: int) -> list[int]:
    return [(agent * 131 + 7 * i) % 250 + 3 for i in range(FIXED_TOKENS[agent])]


def _prompt(agent: int, turn: int) -> list[int]:
    return _fixed(agent) + [(turn * 17 + 5 * i) % 250 + 3 for i in range(8)]


def _scope(agent: int) -> ReuseScope:
    n = len(AGENTS)
    steps = {AGENTS[(agent + k) % n]: k for k in range(n)}
    return ReuseScope("app", AGENTS[agent], None, WorkflowInfo(steps_to_execution=steps, next=[AGENTS[(agent + 1) % n]]))


def _segments(agent: int, turn: int) -> list[TokenSegment]:
    num_fixed = FIXED_TOKENS[agent]
    return [TokenSegment(0, num_fixed, "fixed_prefix", AGENTS[agent]),
            TokenSegment(num_fixed, len(_prompt(agent, turn)), "private")]


def _engine(model_dir: Path, num_blocks: int, **tiers) -> LLMEngine:
    return make_engine(model_dir, num_blocks=num_blocks, reuse=ReuseConfig(enabled=False), tiers=TierConfig(**tiers))


def _run(engine: LLMEngine, agent: int, turn: int) -> Sequence:
    return engine.generate(_prompt(agent, turn), SAMPLING, segments=_segments(agent, turn), scope=_scope(agent))


def _settle(engine: LLMEngine) -> None:
    """Let every transfer in flight land."""
    for _ in range(200):
        engine.tiers.poll(timeout=0.05)
        if engine.tiers.worker.num_in_flight == 0:
            return
    raise AssertionError("transfers did not land")


def _evict_device(engine: LLMEngine) -> None:
    """Drop every cached block from the device tier (the lower tiers keep their copies)."""
    pool = engine.kv.pool
    pool.release(list(reversed(pool.allocate(pool.num_free))))


@pytest.fixture
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture
def reference(model) -> Callable[[int, int], list[int]]:
    """Greedy outputs of an engine with room for everything and no tiers."""
    engine = _engine(model, 128, policy="lru", host_bytes=0)
    return lambda agent, turn: _run(engine, agent, turn).output_token_ids


@pytest.fixture
def gate(monkeypatch) -> threading.Event:
    """Loads into the device tier wait until the event is set."""
    opened = threading.Event()
    real = store_module.tier_to_device

    def gated(*args) -> None:
        if threading.current_thread().name == "kvrelay-kv-transfer":
            assert opened.wait(timeout=30)
        real(*args)

    monkeypatch.setattr(store_module, "tier_to_device", gated)
    return opened


def test_prefetch_lands_before_dispatch_and_outputs_match(model, reference, tmp_path):
    engine = _engine(model, 18, policy="workflow", host_bytes=8 * TINY_BLOCK_BYTES, disk_path=str(tmp_path),
                     disk_bytes=64 * TINY_BLOCK_BYTES, load_ahead=2)
    pool_size = engine.kv.pool.num_blocks
    for turn in range(12):  # three cycles of the four agents
        agent = turn % len(AGENTS)
        seq = _run(engine, agent, turn)
        assert seq.output_token_ids == reference(agent, turn)
        if turn >= len(AGENTS):  # after the cold cycle, the prefix is on the device when the request runs
            assert seq.num_fetched_tokens == 0
            assert seq.num_cached_tokens == FIXED_TOKENS[agent] // BS * BS
        assert engine.kv.pool.num_blocks == pool_size
        assert all(tier.num_used <= tier.num_blocks for tier in engine.tiers.tiers)
    assert engine.prefetcher.num_started > 0 and engine.tiers.stats.num_prefetched > 0
    assert engine.tiers.stats.num_demoted > 0  # the host tier is too small: blocks went on to disk
    engine.close()


def test_lru_evicts_the_next_agent_and_reactive_loading_brings_it_back(model, reference):
    engine = _engine(model, 18, policy="lru", host_bytes=64 * TINY_BLOCK_BYTES)
    for turn in range(8):
        agent = turn % len(AGENTS)
        seq = _run(engine, agent, turn)
        assert seq.output_token_ids == reference(agent, turn)
        if turn >= len(AGENTS):  # cyclic reuse defeats LRU: the prefix comes back from the host tier
            assert seq.num_fetched_tokens == FIXED_TOKENS[agent] // BS * BS
            assert seq.num_cached_tokens == seq.num_fetched_tokens
            (fetch,) = seq.timeline.assembly["tier_fetch"]
            assert fetch.num_tokens == seq.num_fetched_tokens and seq.timeline.stages()["prefill"].holds(fetch)
    assert engine.prefetcher is None and engine.tiers.stats.num_fetched > 0
    engine.close()


def test_lru_without_a_lower_tier_recomputes(model, reference):
    engine = _engine(model, 18, policy="lru", host_bytes=0)
    assert engine.tiers is None
    for turn in range(8):
        seq = _run(engine, turn % len(AGENTS), turn)
        assert seq.output_token_ids == reference(turn % len(AGENTS), turn)
        if turn >= len(AGENTS):
            assert seq.num_cached_tokens == 0


def _prefetching_engine(model: Path, **extra) -> LLMEngine:
    """An engine whose tester prefix sits only in the host tier and is due next."""
    engine = _engine(model, 32, policy="workflow", host_bytes=64 * TINY_BLOCK_BYTES, load_ahead=1, **extra)
    _run(engine, 2, 0)  # tester
    _settle(engine)
    _evict_device(engine)
    _run(engine, 1, 1)  # coder runs; tester is one step away and starts loading
    return engine


def test_a_request_whose_prefix_is_loading_waits_while_ready_ones_run(model, reference, gate):
    engine = _prefetching_engine(model)
    assert engine.tiers.num_loads_in_flight == 1  # the tester's prefix, held at the gate
    tester = engine.add_request(EngineRequest("tester", _prompt(2, 2), SAMPLING, segments=_segments(2, 2), scope=_scope(2)))
    ready = engine.add_request(EngineRequest("other", _prompt(3, 2)[-20:], SAMPLING))
    engine.step()
    assert tester.status is SequenceStatus.WAITING and ready.status is SequenceStatus.RUNNING
    gate.set()
    while not tester.is_finished:
        engine.step()
    assert tester.num_fetched_tokens == 0 and tester.num_cached_tokens == FIXED_TOKENS[2] // BS * BS
    assert tester.output_token_ids == reference(2, 2)
    engine.close()


def test_no_request_waits_past_the_bound_on_a_load(model, reference, gate):
    engine = _prefetching_engine(model, max_load_wait_ms=30.0)
    tester = engine.add_request(EngineRequest("tester", _prompt(2, 2), SAMPLING, segments=_segments(2, 2), scope=_scope(2)))
    while not tester.is_finished:
        engine.step()
    assert not gate.is_set()  # it never arrived: the prefix was recomputed
    assert tester.num_cached_tokens == 0
    assert tester.output_token_ids == reference(2, 2)
    gate.set()
    _settle(engine)
    engine.close()


def test_a_failed_load_is_recomputed_densely(model, reference, monkeypatch):
    def broken(*args) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(store_module, "tier_to_device", broken)
    engine = _prefetching_engine(model)
    tester = engine.add_request(EngineRequest("tester", _prompt(2, 2), SAMPLING, segments=_segments(2, 2), scope=_scope(2)))
    while not tester.is_finished:
        engine.step()
    assert engine.tiers.stats.num_failed == 1
    assert tester.output_token_ids == reference(2, 2)
    engine.close()


def test_blocks_being_offloaded_are_never_evicted(model):
    engine = _engine(model, 32, policy="lru", host_bytes=64 * TINY_BLOCK_BYTES)
    seq = engine.add_request(EngineRequest("r", _prompt(0, 0), SAMPLING))
    engine.step()  # prefill: its full blocks are published and their backup starts
    pinned = [b for b in seq.blocks if b.block_hash is not None]
    assert pinned and all(b.ref_count == 2 for b in pinned)  # the sequence and the backup
    engine.abort("r")
    assert all(b.ref_count == 1 for b in pinned)  # still pinned by the backup in flight
    taken = engine.kv.pool.allocate(engine.kv.pool.num_free)
    assert not set(map(id, taken)) & set(map(id, pinned))
    engine.kv.pool.release(taken)
    _settle(engine)
    assert all(b.ref_count == 0 for b in pinned)
    engine.close()


def test_a_failed_reactive_load_is_recomputed_and_the_blocks_forgotten(model, reference, monkeypatch):
    engine = _engine(model, 32, policy="lru", host_bytes=64 * TINY_BLOCK_BYTES)
    _run(engine, 2, 0)
    _settle(engine)
    _evict_device(engine)
    num_blocks = FIXED_TOKENS[2] // BS
    assert engine.tiers.stats.num_backed_up == num_blocks

    def broken(*args) -> None:
        raise OSError("unreadable")

    monkeypatch.setattr(store_module, "tier_to_device", broken)
    seq = _run(engine, 2, 1)
    assert seq.output_token_ids == reference(2, 1)
    assert seq.num_cached_tokens == 0 and engine.tiers.stats.num_failed == 1
    _settle(engine)  # the dropped blocks, recomputed, were backed up anew
    assert engine.tiers.stats.num_backed_up == 2 * num_blocks
    engine.close()


def test_concurrent_prefetches_are_bounded_and_every_branch_is_loaded(model, gate):
    engine = _engine(model, 48, policy="workflow", host_bytes=64 * TINY_BLOCK_BYTES, load_ahead=2, max_prefetches=1)
    for agent in (1, 2, 3):
        _run(engine, agent, 0)
    _settle(engine)
    _evict_device(engine)
    # The planner runs; coder and tester are both possible next agents (a conditional branch).
    branch = WorkflowInfo(steps_to_execution={"planner": 0, "coder": 1, "tester": 1, "reviewer": 2},
                          next=["coder", "tester"])
    engine.add_request(EngineRequest("p", _prompt(0, 1), SAMPLING, segments=_segments(0, 1),
                       scope=ReuseScope("app", "planner", None, branch)))
    engine.step()
    assert engine.tiers.num_loads_in_flight == 1  # the bound
    gate.set()
    while engine.has_work or engine.tiers.worker.num_in_flight:
        engine.step()
    for agent in (1, 2, 3):
        hashes = engine.workflows._prefixes[("app", AGENTS[agent])]
        assert all(engine.kv.pool.lookup(h) is not None for h in hashes)
    engine.close()


def test_an_idle_engine_starts_the_next_prefetch_when_a_load_lands(model, gate, monkeypatch):
    """The last request ends while the first prefetch is still loading; that load lands
    during an idle step's wait. The engine must start the next due prefetch then, or it
    stops stepping (no request, nothing in flight) with two agents left on the host tier."""
    engine = _engine(model, 48, policy="workflow", host_bytes=64 * TINY_BLOCK_BYTES, load_ahead=2, max_prefetches=1)
    for agent in (1, 2, 3):
        _run(engine, agent, 0)
    _settle(engine)
    _evict_device(engine)
    poll = engine.tiers.poll

    def land_while_idle(timeout: float = 0.0) -> None:
        if timeout > 0 and not gate.is_set():  # the idle wait: let the held load land in it
            gate.set()
            timeout = 5.0
        poll(timeout)

    monkeypatch.setattr(engine.tiers, "poll", land_while_idle)
    branch = WorkflowInfo(steps_to_execution={"planner": 0, "coder": 1, "tester": 1, "reviewer": 2},
                          next=["coder", "tester"])
    engine.add_request(EngineRequest("p", _prompt(0, 1), SAMPLING, segments=_segments(0, 1),
                       scope=ReuseScope("app", "planner", None, branch)))
    while engine.has_work:
        engine.step()
    assert gate.is_set()
    for agent in (1, 2, 3):
        hashes = engine.workflows._prefixes[("app", AGENTS[agent])]
        assert all(engine.kv.pool.lookup(h) is not None for h in hashes), AGENTS[agent]
    engine.close()


def test_three_out_of_phase_sessions_of_one_app_each_have_their_next_agent_due(model):
    """KVFlow per session through the engine: the plan's session id reaches the workflow
    table, so after every request each session's next agent (from the script, never the
    policy's prediction) is ranked within load_ahead, i.e. the prefetcher would load it."""
    engine = _engine(model, 64, policy="workflow", host_bytes=64 * TINY_BLOCK_BYTES, load_ahead=ring.LOAD_AHEAD)
    num_fixed = 48
    fixed = [[(agent * 37 + 11 * i) % 250 + 3 for i in range(num_fixed)] for agent in range(ring.NUM_AGENTS)]
    turns = itertools.count()

    def run(session: int, agent: int) -> None:
        turn = next(turns)
        prompt = fixed[agent] + [(turn * 13 + 3 * i) % 250 + 3 for i in range(8)]
        info = WorkflowInfo(steps_to_execution=ring.ring_steps(agent),
                            next=[ring.AGENTS[(agent + 1) % ring.NUM_AGENTS]])
        scope = ReuseScope("app", ring.AGENTS[agent], None, info, session_id=f"s{session}")
        segments = [TokenSegment(0, num_fixed, "fixed_prefix", ring.AGENTS[agent]),
                    TokenSegment(num_fixed, len(prompt), "private")]
        engine.generate(prompt, SAMPLING, segments=segments, scope=scope)

    def due() -> set[str]:
        return {u.agent.agent_id for u in engine.workflows.upcoming(engine.config.tiers.load_ahead)}

    passed, checks = ring.replay(run, due)
    assert checks == 144 and passed / checks >= 0.95
    assert len(engine.workflows.sessions) == len(ring.PHASES)
    engine.close()


@pytest.mark.parametrize("driver", [None, AsyncEngine], ids=["alone", "async_engine"])
def test_an_engine_nobody_closed_takes_its_transfer_worker_and_tiers_with_it(model, driver):
    """The worker thread must not outlive its engine: through the transfers it finished
    it held the host tier, so every engine a process built and dropped leaked its tier.
    Nor may an AsyncEngine's ring on that thread keep its engine alive (it did, and a
    suite that built many engines ran out of memory)."""
    import gc
    import weakref

    engine = _engine(model, 16, host_bytes=16 * 2**20)
    _run(engine, 0, 0)
    _settle(engine)
    if driver is not None:
        driver(engine)  # never started or stopped: only its ring on the transfer thread stays
    thread = engine.tiers.worker._thread
    assert thread.is_alive()
    storage = weakref.ref(engine.tiers.tiers[0].storage)
    del engine
    gc.collect()
    thread.join(timeout=5)
    gc.collect()
    assert not thread.is_alive()
    assert storage() is None  # the host tier's memory went with it


def test_an_empty_step_waits_for_a_transfer_only_without_a_driver_to_wake(model, monkeypatch):
    """Stepped directly, a step with nothing to run waits up to 5 ms for a landing transfer
    (no spinning); under a driver that is rung as transfers land (`wake_on_transfers`), it
    returns at once, so a request arriving meanwhile is admitted without that wait."""
    engine = _engine(model, 16, host_bytes=16 * 2**20)
    waits: list[float] = []
    completed = engine.tiers.worker.completed

    def spy(timeout: float = 0.0):
        waits.append(timeout)
        return completed(timeout)

    monkeypatch.setattr(engine.tiers.worker, "completed", spy)
    engine.step()
    assert waits[-1] == 0.005
    rings: list[bool] = []
    engine.wake_on_transfers(lambda: rings.append(True))
    engine.step()
    assert waits[-1] == 0.0
    _run(engine, 0, 0)  # its published blocks are backed up: each landed copy rings
    _settle(engine)
    assert rings
    engine.close()


async def test_an_async_engine_applies_backups_that_land_while_it_sleeps(model):
    """With nothing to step, the engine thread sleeps on its command queue; the host tier's
    backups of an answered request still land and are applied (their blocks unpinned), and
    the next request reuses the prefix exactly."""
    engine = _engine(model, 16, host_bytes=16 * 2**20)
    runner = AsyncEngine(engine)
    runner.start()
    try:
        outputs = []
        for turn in (0, 1):
            request = EngineRequest(f"r{turn}", _prompt(0, turn), SAMPLING, segments=_segments(0, turn),
                                    scope=_scope(0))
            outputs.append([o async for o in runner.generate(request)][-1])
            await asyncio.to_thread(wait_until, lambda: engine.tiers.worker.num_in_flight == 0, 10.0)
        assert engine.tiers.stats.num_backed_up > 0
        assert all(block.ref_count == 0 for block in engine.kv.pool.blocks)
        assert outputs[1].num_cached_tokens >= FIXED_TOKENS[0]
    finally:
        runner.stop()

