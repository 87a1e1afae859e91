"""Gateway replicas sharing what they infer: a village's rounds spread over replicas plan
as on one gateway (one session, placeholders for answers another replica relayed, the
same homes), on SQLite and PostgreSQL, with no wait between requests; and what the
shared log does with rows it cannot read."""

from __future__ import annotations

import asyncio
import json
import random
import time

import openai
import pytest
from pydantic import ValidationError
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import create_async_engine

from kvrelay.gateway.inference.replication import SharedLog
from kvrelay.gateway.settings import GatewaySettings
from kvrelay.gateway.storage.models import ObservationRow
from kvrelay.wire.plan import SegmentPlan
from tests.gateway.village import NUM_AGENTS, clients_for, village_round



def _settled(gateways, timeout: float = 10.0) -> None:
    """Wait until every replica has applied every other replica's observations."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = [g.state.replicas.log for g in gateways]
        published = sum(log.num_published for log in logs)
        if all(log.backlog == 0 for log in logs) and all(
                log.num_applied == published - log.num_published for log in logs):
            return
        time.sleep(0.01)
    raise AssertionError("replicas did not settle")


def _village(gateways, fake, rounds: int, settle: bool = True) -> tuple[list[list[SegmentPlan]], list[list[dict]]]:
    """All-Gather rounds of three villagers, request i sent to gateway i mod N."""
    clients, rng, outputs = clients_for(gateways), random.Random(3), []
    plans: list[list[SegmentPlan]] = []
    bodies: list[list[dict]] = []
    for r in range(rounds):
        played = village_round(clients, fake, r, outputs, rng, before_each=(lambda: _settled(gateways)) if settle else None)
        outputs = played.answers
        plans.append(played.plans)
        bodies.append(played.bodies)
    return plans, bodies


def _quoted(plan: SegmentPlan, body: dict) -> list[str]:
    return sorted(body["messages"][s.message_index]["content"][s.char_start:s.char_end]
                  for s in plan.segments if s.kind == "placeholder")


@pytest.mark.parametrize(("replicas", "settle"), [(2, True), (3, True), (3, False)])
def test_rounds_spread_over_replicas_plan_as_on_one_gateway(fake_upstream, start_gateway, db_url, replicas, settle):
    """`settle`: each request waits until every replica applied everything; without it,
    the causal barrier alone (an answer is in the log before its client has it, and a
    request with news catches up before planning) must give the same plans."""
    fake = fake_upstream()
    gateways = [start_gateway([fake.url], database_url=db_url, replication={"enabled": True, "replica_id": f"r{n}"})
                for n in range(replicas)]
    plans, bodies = _village(gateways, fake, rounds=3, settle=settle)
    flat = [p for r in plans for p in r]
    assert {p.session_id for p in flat} == {flat[0].session_id}  # one session, whoever planned
    assert [p.agent_id for p in plans[2]] == [p.agent_id for p in plans[0]]
    assert [p.round.index for p in plans[2]] == [0, 1, 2] and {p.round.size for p in plans[2]} == {3}
    for plan, body in zip(plans[2], bodies[2]):  # every answer of round 1 found, whichever replica relayed it
        assert len(_quoted(plan, body)) == NUM_AGENTS
        assert {s.name for s in plan.segments if s.kind == "placeholder"} == {
            f"agent_{p.agent_id}_current" for p in plans[0]}
    _settled(gateways)
    homes = {g.state.upstreams.pool.homes.get(flat[0].session_id).url for g in gateways}
    assert homes == {fake.url}


def test_replicas_that_share_nothing_split_the_village(fake_upstream, start_gateway):
    """The control: the same traffic over two gateways with their own state loses the
    session and the placeholders (what the shared log is for)."""
    fake = fake_upstream()
    gateways = [start_gateway([fake.url]) for _ in range(2)]
    plans, bodies = _village(gateways, fake, rounds=2, settle=False)
    flat = [p for r in plans for p in r]
    assert len({p.session_id for p in flat}) > 1
    assert any(len(_quoted(p, b)) < NUM_AGENTS for p, b in zip(plans[1], bodies[1]))


@pytest.mark.parametrize("agreed", [True, False])
def test_replicas_that_start_a_session_at_once_start_the_same_one(fake_upstream, start_gateway, tmp_path, agreed):
    """The first prompts of a round's agents, each planned by another replica before it
    has read the other's plan, land in one session: replicas derive a new session's id
    alike. The control (random ids, as one gateway mints them) splits the round."""
    fake = fake_upstream()
    db = f"sqlite+aiosqlite:///{tmp_path}/shared.sqlite"
    gateways = [start_gateway([fake.url], database_url=db, replication={"enabled": True, "replica_id": f"r{n}"})
                for n in range(2)]
    held: list[tuple[str, dict]] = []
    gateways[1].state.replicas.log._apply = lambda kind, payload: held.append((kind, payload))  # deaf to r0
    for gw in gateways:
        gw.state.inference.agreed_session_ids = agreed
    played = village_round(clients_for(gateways), fake, 0, [], random.Random(3))
    assert [kind for kind, _ in held] and "plan" in {kind for kind, _ in held}  # r1 planned without r0's plans
    sessions = {p.session_id for p in played.plans}
    assert len(sessions) == 1 if agreed else len(sessions) > 1


def test_a_new_sessions_home_is_the_same_on_every_replica(fake_upstream, start_gateway, tmp_path):
    fakes = [fake_upstream() for _ in range(3)]
    urls = [f.url for f in fakes]
    db = f"sqlite+aiosqlite:///{tmp_path}/shared.sqlite"
    gateways = [start_gateway(urls, database_url=db, replication={"enabled": True, "replica_id": f"r{n}"})
                for n in range(2)]
    homes = {}
    for n in range(12):
        session = f"team-{n}"
        for gw in gateways:  # each replica plans one request of the session before hearing of the other's
            openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0).chat.completions.create(
                model="fake", messages=[{"role": "user", "content": f"hello {n}"}],
                extra_headers={"x-session-id": session})
        homes[session] = {gw.state.upstreams.pool.homes.get(session).url for gw in gateways}
    assert all(len(found) == 1 for found in homes.values())
    assert len({next(iter(found)) for found in homes.values()}) >= 2  # hashed: spread over the upstreams


def test_replication_needs_a_database_the_replicas_share():
    with pytest.raises(ValidationError, match="replication needs a database"):
        GatewaySettings(database_url="sqlite+aiosqlite:///:memory:", replication={"enabled": True})


def test_a_row_that_cannot_be_applied_is_skipped_and_counted(db_url):
    applied: list[tuple[str, dict]] = []

    def apply(kind: str, payload: dict) -> None:
        if kind != "plan":
            raise ValueError(f"unknown observation kind {kind!r}")
        payload["n"]  # noqa: B018 - a KeyError on a payload without it
        applied.append((kind, payload))

    async def run() -> SharedLog:
        engine = create_async_engine(db_url)
        log = SharedLog(engine, "me", apply)
        await log.start()
        now = time.time()
        rows = [("other", "plan", json.dumps({"n": 1})), ("other", "bogus", "{}"), ("other", "plan", "not json"),
                ("other", "plan", json.dumps({})), ("me", "plan", json.dumps({"n": 9})),
                ("other", "plan", json.dumps({"n": 2}))]
        from datetime import UTC, datetime
        async with log.engine.begin() as conn:
            await conn.execute(insert(ObservationRow.__table__), [
                {"replica": r, "kind": k, "payload": p, "observed_at": now, "created_at": datetime.now(UTC)}
                for r, k, p in rows])
        assert await log.read_once() == len(rows)
        assert await log.read_once() == 0
        await log.close()
        await engine.dispose()
        return log

    log = asyncio.run(run())
    assert [p["n"] for _, p in applied] == [1, 2]  # its own row skipped, bad ones counted
    assert log.num_applied == 2 and log.num_apply_errors == 3
    assert log.staleness_quantile(0.99) is not None
