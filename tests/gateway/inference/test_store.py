"""StateStore: inferred state saved to SQLite and PostgreSQL and rebuilt, so a restarted
gateway plans the next request exactly as one that never stopped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import create_async_engine

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference, StateStore
from kvrelay.gateway.settings import InferenceSettings
from kvrelay.gateway.storage.models import InferredSessionRow, SegmentRow

QUESTION = "Plan a three-day walking trip through the Lake District for two people in late spring."
SYSTEMS = {a: f"You are the {a} of a travel agency team. Answer in short, concrete sentences." for a in
           ("Planner", "Booker", "Critic")}


def _answer(agent: str, turn: int) -> str:
    return f"{agent} (turn {turn}): day {turn + 1} goes from Keswick over Cat Bells, lunch by Derwentwater, and back."


def _request(inference: Inference, agent: str, turn: int, transcript: list[tuple[str, str]], app: str,
             session: str | None, respond: bool = True):
    body = {"model": "m", "messages": [{"role": "system", "content": SYSTEMS[agent]},
                                       {"role": "user", "content": QUESTION},
                                       *({"role": "user", "name": who, "content": said} for who, said in transcript)]}
    headers = {"x-kvrelay-app": app, **({"x-session-id": session} if session else {})}
    result = inference.plan(identify(headers, body, None), body, f"req-{app}-{turn}-{agent}", "m")
    if respond:
        inference.observe_response(app, result.session_id, result.agent_id, f"req-{app}-{turn}-{agent}",
                                   _answer(agent, turn))
    return result


def _converse(inference: Inference, app: str, session: str | None, turns: int) -> list[tuple[str, str]]:
    transcript: list[tuple[str, str]] = []
    for turn in range(turns):
        for agent in SYSTEMS:
            _request(inference, agent, turn, transcript, app, session)
            transcript.append((agent, _answer(agent, turn)))
    return transcript


def _without_ids(result) -> dict:
    return result.plan.model_dump(exclude={"request_id"})


@asynccontextmanager
async def _store(url: str, inference: Inference) -> AsyncIterator[StateStore]:
    engine = create_async_engine(url)
    try:
        yield StateStore(engine, inference)
    finally:
        await engine.dispose()


def test_a_rebuilt_gateway_plans_the_next_request_like_one_that_never_stopped(db_url):
    async def run() -> None:
        live = Inference(InferenceSettings())
        transcripts = {app: _converse(live, app, session, 3) for app, session in (("a", "s1"), ("b", None))}
        async with _store(db_url, live) as store:
            assert await store.flush() > 0
            assert await store.flush() == 0  # nothing changed since

        rebuilt = Inference(InferenceSettings())
        async with _store(db_url, rebuilt) as store:
            loaded = await store.load()
        assert loaded.num_sessions == 2 and loaded.num_agents == 6
        for app, session in (("a", "s1"), ("b", None)):
            expected = _request(live, "Critic", 3, transcripts[app], app, session, respond=False)
            got = _request(rebuilt, "Critic", 3, transcripts[app], app, session, respond=False)
            assert _without_ids(got) == _without_ids(expected)
            assert any(s.kind == "placeholder" for s in got.plan.segments)
            assert sorted(rebuilt.app(app).graph.edges()) == sorted(live.app(app).graph.edges())

    asyncio.run(run())


def test_only_new_texts_are_written_again(db_url):
    async def run() -> None:
        inference = Inference(InferenceSettings())
        async with _store(db_url, inference) as store:
            transcript = _converse(inference, "a", "s1", 1)
            await store.flush()
            _request(inference, "Planner", 1, transcript, "a", "s1")
            written = await store.flush()
        # The session, its new answer, the agent and its 3 edges, and the Critic with its 3: its answer is
        # quoted under its name for the first time, which names it. A transcript forms no round.
        assert written == 1 + 1 + (1 + 3) + (1 + 3)
        engine = create_async_engine(db_url)
        async with engine.connect() as conn:
            assert (await conn.execute(select(func.count()).select_from(SegmentRow))).scalar_one() == 5
        await engine.dispose()

    asyncio.run(run())


def test_a_session_out_of_memory_is_restored_on_demand_and_a_missing_one_is_not(db_url):
    async def run() -> None:
        inference = Inference(InferenceSettings(max_sessions=1))
        async with _store(db_url, inference) as store:
            transcript = _converse(inference, "a", "s1", 2)
            await store.flush()
            _converse(inference, "a", "s2", 1)  # pushes s1 out of memory
            assert not inference.has_session("a", "s1")
            assert await store.restore("a", "s1")
            assert not await store.restore("a", "s1")  # already in memory
            assert not await store.restore("a", "nowhere")
            assert not await store.restore("b", "s1")  # another app's session of that name: none
            assert await store.sessions_named("s1") == ["a"]
        result = _request(inference, "Planner", 2, transcript, "a", "s1", respond=False)
        names = {s.name for s in result.plan.segments if s.kind == "placeholder"}
        assert {"user_question", "agent_Booker_current", "agent_Booker_history_1"} <= {
            n.replace(_agent(inference, "Booker"), "Booker") for n in names if n}

    asyncio.run(run())


def _agent(inference: Inference, role: str) -> str:
    return _agent_of(inference, "a", role)


def test_a_failed_save_keeps_its_changes_for_the_next(tmp_path):
    async def run() -> None:
        inference = Inference(InferenceSettings())
        _converse(inference, "a", "s1", 1)
        async with _store(f"sqlite+aiosqlite:///{tmp_path}/missing-dir/x.db", inference) as store:
            with pytest.raises(OperationalError):
                await store.flush()
            assert ("a", "s1") in inference.changes.sessions and store.num_save_errors == 1
        session = inference.app("a").sessions["s1"]
        assert session.num_saved_texts == 0

    asyncio.run(run())


def test_a_save_cancelled_mid_write_keeps_its_changes(db_url):
    async def run() -> None:
        inference = Inference(InferenceSettings())
        _converse(inference, "a", "s1", 1)
        async with _store(db_url, inference) as store:
            task = asyncio.create_task(store.flush())
            await asyncio.sleep(0)  # it took the changes and is waiting on the database
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert inference.changes
            await store.flush()
        engine = create_async_engine(db_url)
        async with engine.connect() as conn:
            assert (await conn.execute(select(func.count()).select_from(InferredSessionRow))).scalar_one() == 1
        await engine.dispose()

    asyncio.run(run())


def test_a_restore_that_fails_pauses_restores_instead_of_stalling_every_request(tmp_path):
    async def run() -> None:
        inference = Inference(InferenceSettings())
        async with _store(f"sqlite+aiosqlite:///{tmp_path}/missing-dir/x.db", inference) as store:
            assert not await store.restore("a", "s1")
            loop = asyncio.get_running_loop()
            start = loop.time()
            assert not await store.restore("a", "s2")
            assert loop.time() - start < 0.01  # paused: no second attempt

    asyncio.run(run())


def test_sessions_idle_past_the_ttl_are_not_loaded_at_start(db_url):
    async def run() -> None:
        inference = Inference(InferenceSettings())
        _converse(inference, "a", "s1", 1)
        session = inference.app("a").sessions["s1"]
        session.last_seen -= 10_000  # idle for hours
        async with _store(db_url, inference) as store:
            await store.flush()
        rebuilt = Inference(InferenceSettings(session_ttl_s=600))
        async with _store(db_url, rebuilt) as store:
            loaded = await store.load()
        assert loaded.num_sessions == 0 and loaded.num_agents == 3

    asyncio.run(run())


def test_agents_evicted_between_saves_do_not_break_them_and_a_restart_keeps_the_latest(db_url):
    async def run() -> None:
        crowded = Inference(InferenceSettings(max_agents=2))  # three agents take turns: one is always out
        _converse(crowded, "a", "s1", 2)
        assert crowded.bounded["agents_evicted"] > 0 and len(crowded.changes.agents) == 3
        async with _store(db_url, crowded) as store:
            assert await store.flush() > 0  # the evicted agent's row is simply not rebuilt
            assert not crowded.changes

        live = Inference(InferenceSettings())
        transcript = _converse(live, "b", "s2", 1)
        async with _store(db_url, live) as store:
            await store.flush()
            await asyncio.sleep(0.01)  # the next save's rows are newer
            for agent in ("Booker", "Critic"):
                _request(live, agent, 1, transcript, "b", "s2")
            await store.flush()
        rebuilt = Inference(InferenceSettings(max_agents=2))
        async with _store(db_url, rebuilt) as store:
            await store.load()
        app = rebuilt.app("b")
        assert sorted(app.agents) == sorted(_agent_of(live, "b", role) for role in ("Booker", "Critic"))
        assert set(app.graph.nodes) <= set(app.agents)

    asyncio.run(run())


def _agent_of(inference: Inference, app: str, role: str) -> str:
    return next(a.id for a in inference.app(app).agents.values() if a.prefix.candidate and role in a.prefix.candidate)


def test_a_session_merged_into_another_leaves_sql_and_its_texts_come_back_in_the_other(db_url):
    async def run() -> None:
        inference = Inference(InferenceSettings())
        async with _store(db_url, inference) as store:
            _converse(inference, "a", "s1", 1)
            _converse(inference, "a", "s2", 1)
            await store.flush()
            app = inference.app("a")
            merged_texts = len(app.sessions["s2"].texts)
            app.sessions["s1"].members.clear()  # as if s2's agents had never asked in s1
            app.merge(app.sessions["s1"], app.sessions["s2"])
            inference.changes.merged.add(("a", "s2"))
            inference.changes.sessions.add(("a", "s1"))
            await store.flush()
            kept = len(app.sessions["s1"].texts)
        engine = create_async_engine(db_url)
        async with engine.connect() as conn:
            sessions = (await conn.execute(select(InferredSessionRow.session_id))).scalars().all()
            segments = (await conn.execute(select(func.count()).select_from(SegmentRow)
                                           .where(SegmentRow.session_id == "s1"))).scalar_one()
            orphans = (await conn.execute(select(func.count()).select_from(SegmentRow)
                                          .where(SegmentRow.session_id == "s2"))).scalar_one()
        await engine.dispose()
        assert sessions == ["s1"] and orphans == 0 and segments == kept
        assert kept >= merged_texts + 1  # s2's texts, renumbered after s1's own
        rebuilt = Inference(InferenceSettings())
        async with _store(db_url, rebuilt) as store:
            await store.load()
        assert not rebuilt.has_session("a", "s2") and len(rebuilt.app("a").sessions["s1"].texts) == kept

    asyncio.run(run())
