"""Records reach SQLite and a real PostgreSQL: alembic round trip, batched writes, and
no record lost while the database is down."""

from __future__ import annotations

import asyncio
import subprocess
import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import func, inspect, select
from sqlalchemy.ext.asyncio import create_async_engine

from kvrelay.gateway.storage import RecordWriter, RequestRecord, RequestRow, SessionRow
from kvrelay.gateway.storage import migrate
from kvrelay.gateway.storage.models import AgentRow
from tests.gateway.conftest import PG_CTL, PG_URL, needs_pg

def record(i: int, session: str | None = "s1", agent: str | None = "a1") -> RequestRecord:
    now = datetime.now(UTC)
    return RequestRecord(
        id=f"req-{i}", endpoint="/v1/chat/completions", stream=True, started_at=now, finished_at=now,
        latency_ms=12.5, status="ok", http_status=200, prompt_sha256="0" * 64, prompt_chars=10,
        session_id=session, agent_id=agent, model="m", upstream="http://u", prompt_tokens=5,
        completion_tokens=3, cached_tokens=2, ttft_ms=4.0, first_token_at=now,
    )


async def count_rows(url: str, table) -> int:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return (await conn.execute(select(func.count()).select_from(table))).scalar_one()
    finally:
        await engine.dispose()


def test_alembic_upgrade_downgrade_round_trip(db_url):
    async def tables() -> set[str]:
        engine = create_async_engine(db_url)
        try:
            async with engine.connect() as conn:
                return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
        finally:
            await engine.dispose()

    assert {"sessions", "agents", "requests"} <= asyncio.run(tables())
    migrate.downgrade(db_url, "base")
    assert not {"sessions", "agents", "requests"} & asyncio.run(tables())
    migrate.upgrade(db_url)
    assert {"sessions", "agents", "requests"} <= asyncio.run(tables())


async def test_writer_batches_records_with_sessions_and_agents(db_url):
    engine = create_async_engine(db_url)
    writer = RecordWriter(engine, queue_size=1000, batch_size=7)
    writer.start()
    for i in range(20):
        writer.submit(record(i, session=f"s{i % 3}", agent=f"a{i % 2}"))
    writer.submit(record(99, session=None, agent=None))
    await writer.close()
    await engine.dispose()
    assert writer.num_written == 21
    assert await count_rows(db_url, RequestRow) == 21
    assert await count_rows(db_url, SessionRow) == 3
    assert await count_rows(db_url, AgentRow) == 2
    check = create_async_engine(db_url)
    async with check.connect() as conn:
        row = (await conn.execute(select(RequestRow).where(RequestRow.id == "req-4"))).one()
    await check.dispose()
    assert (row.status, row.prompt_tokens, row.cached_tokens, row.ttft_ms) == ("ok", 5, 2, 4.0)
    assert row.prompt_text is None and row.completion_text is None


async def test_text_no_database_takes_as_it_is_is_stored_not_refused(db_url):
    """NUL (PostgreSQL refuses it in text), a lone surrogate (no UTF-8 form; an upstream's
    answer can carry one) and ids past their column's width are stored, changed only
    in the stored copy, and found again by the same value."""
    engine = create_async_engine(db_url)
    writer = RecordWriter(engine, queue_size=100, batch_size=8)
    writer.start()
    bad = record(1, session="s\x00" + "x" * 200, agent="a\x00")
    bad.model, bad.prompt_text, bad.completion_text = "m\x00" * 300, "p\x00q", "c\ud800d"
    writer.submit(bad)
    writer.submit(record(2))
    await writer.close()
    assert (writer.num_written, writer.num_quarantined) == (2, 0)
    async with engine.connect() as conn:
        row = (await conn.execute(select(RequestRow).where(RequestRow.session_id == bad.session_id))).one()
    await engine.dispose()
    assert row.id == "req-1" and row.prompt_text == "p\ufffdq" and row.completion_text == "c\ufffdd"
    assert row.model == ("m\ufffd" * 300)[:256] and len(row.session_id) == 128


@pytest.mark.slow
@needs_pg
async def test_no_record_lost_across_a_30_second_postgres_outage():
    assert PG_CTL, "with-postgres.sh exports KVRELAY_TEST_PG_CTL"
    await asyncio.to_thread(migrate.downgrade, PG_URL, "base")  # alembic's env runs its own loop
    await asyncio.to_thread(migrate.upgrade, PG_URL)
    engine = create_async_engine(PG_URL, pool_pre_ping=True)
    writer = RecordWriter(engine, queue_size=10_000, batch_size=50)
    writer.start()
    for i in range(50):
        writer.submit(record(i))
    await asyncio.sleep(0.5)
    subprocess.run(f"{PG_CTL} -m fast stop", shell=True, check=True, capture_output=True)
    try:
        outage_end = time.monotonic() + 30
        i = 50
        while time.monotonic() < outage_end:  # traffic keeps arriving during the outage
            writer.submit(record(i))
            i += 1
            await asyncio.sleep(0.05)
        assert writer.num_write_errors > 0  # the writer really hit the outage
    finally:
        subprocess.run(f"{PG_CTL} -w start", shell=True, check=True, capture_output=True)
    total = i
    await writer.close(timeout_s=60)
    await engine.dispose()
    assert writer.num_dropped == 0
    assert await count_rows(PG_URL, RequestRow) == total
