"""RecordWriter against SQLite: outages lose nothing and duplicate nothing, close() drains,
overflow drops the oldest; and a malformed upstream usage must not wedge the writer."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import create_async_engine

from kvrelay.gateway.storage.models import Base
from kvrelay.gateway.storage.writer import RecordWriter, RequestRecord
from tests.gateway.support import read_rows

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}]}


def record(i: int, session: str | None = None) -> RequestRecord:
    now = datetime.now(UTC)
    return RequestRecord(id=f"req-{i:04d}", endpoint="/v1/completions", stream=False, started_at=now,
                         finished_at=now, latency_ms=1.0, status="ok", http_status=200,
                         prompt_sha256="0" * 64, prompt_chars=1, session_id=session, model="m")


def create_schema(path) -> None:
    engine = create_engine(f"sqlite:///{path}")
    Base.metadata.create_all(engine)
    engine.dispose()


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "records.sqlite"
    create_schema(path)
    return path


async def wait_for(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def ids(path) -> list[str]:
    return sorted(r.id for r in read_rows(path))


async def test_close_drains_the_queue(db):
    engine = create_async_engine(f"sqlite+aiosqlite:///{db}")
    writer = RecordWriter(engine, queue_size=10_000, batch_size=64)
    writer.start()
    for i in range(300):
        writer.submit(record(i, session=f"s{i % 5}"))
    await writer.close(timeout_s=10)
    await engine.dispose()
    assert (writer.num_written, writer.num_dropped, writer.backlog) == (300, 0, 0)
    assert ids(db) == [f"req-{i:04d}" for i in range(300)]


async def test_no_record_lost_while_the_database_cannot_be_opened(tmp_path):
    folder = tmp_path / "not-yet"  # sqlite cannot open a file in a missing directory
    path = folder / "records.sqlite"
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    writer = RecordWriter(engine, queue_size=1000, batch_size=4)
    writer.start()
    for i in range(10):
        writer.submit(record(i))
    await wait_for(lambda: writer.num_write_errors >= 1)
    for i in range(10, 25):  # traffic keeps coming during the outage
        writer.submit(record(i))
        await asyncio.sleep(0.01)
    assert writer.num_written == 0
    folder.mkdir()
    create_schema(path)  # the database is back
    await writer.close(timeout_s=10)
    await engine.dispose()
    assert (writer.num_written, writer.num_dropped) == (25, 0)
    assert writer.num_write_errors >= 1
    assert ids(path) == [f"req-{i:04d}" for i in range(25)]


async def test_failed_writes_are_retried_without_duplicates(db, monkeypatch):
    engine = create_async_engine(f"sqlite+aiosqlite:///{db}")
    writer = RecordWriter(engine, queue_size=1000, batch_size=8)
    real_write = writer._write
    calls = []

    async def flaky(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise OperationalError("INSERT", {}, Exception("database is locked"))
        if len(calls) == 2:  # the write lands but the commit's answer is lost: retried as well
            await real_write(batch)
            raise OperationalError("COMMIT", {}, Exception("connection reset"))
        await real_write(batch)

    monkeypatch.setattr(writer, "_write", flaky)
    writer.start()
    for i in range(20):
        writer.submit(record(i, session="s1"))
    await writer.close(timeout_s=10)
    await engine.dispose()
    assert writer.num_write_errors == 2
    assert writer.num_written == 20
    assert ids(db) == [f"req-{i:04d}" for i in range(20)]  # each once


async def test_overflow_drops_the_oldest_and_close_does_not_hang(db, caplog):
    engine = create_async_engine(f"sqlite+aiosqlite:///{db}")
    writer = RecordWriter(engine, queue_size=3, batch_size=8)
    for i in range(5):  # the writer is not running yet: the queue overflows
        writer.submit(record(i))
    assert (writer.num_dropped, writer.backlog) == (2, 3)
    writer.start()
    await wait_for(lambda: writer.num_written == 3)
    caplog.set_level(logging.ERROR, logger="kvrelay.gateway.storage.writer")
    t0 = time.monotonic()
    await writer.close(timeout_s=1.5)
    elapsed = time.monotonic() - t0
    await engine.dispose()
    assert ids(db) == ["req-0002", "req-0003", "req-0004"]
    # everything that was kept is written: close() has nothing left to wait for
    assert elapsed < 0.5, f"close() waited {elapsed:.1f}s for a queue that was already drained"
    assert "did not drain" not in caplog.text


def test_malformed_upstream_usage_does_not_wedge_the_records(fake_upstream, start_gateway):
    """An upstream whose usage carries a non-number must not stop every later record."""
    fake = fake_upstream(usage={"prompt_tokens": {"text": 5}, "completion_tokens": [4], "total_tokens": 9})
    gw = start_gateway([fake.url])
    writer = gw.state.writer
    close = writer.close
    writer.close = lambda timeout_s=10.0: close(min(timeout_s, 1.0))  # a wedged writer: keep shutdown short
    with gw.client() as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        fake.behaviour.usage = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    rows = gw.rows(2, timeout=3)
    assert [r.status for r in rows] == ["ok", "ok"]
    assert (rows[1].prompt_tokens, rows[1].completion_tokens) == (7, 4)


@pytest.mark.parametrize("error", [ValueError("a bug"), UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogate"),
                                   OperationalError("INSERT", {}, Exception("a poison that looks like an outage"))],
                         ids=["bug", "unencodable", "persistent-operational"])
async def test_a_record_the_database_refuses_is_quarantined_and_the_rest_are_written(db, monkeypatch, error):
    engine = create_async_engine(f"sqlite+aiosqlite:///{db}")
    writer = RecordWriter(engine, queue_size=1000, batch_size=8)
    real_write = writer._write
    monkeypatch.setattr("kvrelay.gateway.storage.writer.asyncio.sleep", _no_wait)

    async def refuse_poison(batch):
        if any(r.id == "req-0003" for r in batch):
            raise error
        await real_write(batch)

    monkeypatch.setattr(writer, "_write", refuse_poison)
    writer.start()
    for i in range(20):
        writer.submit(record(i, session="s1"))
    await writer.close(timeout_s=10)
    await engine.dispose()
    assert (writer.num_written, writer.num_quarantined) == (19, 1)
    assert ids(db) == [f"req-{i:04d}" for i in range(20) if i != 3]


async def _no_wait(_: float) -> None:
    return None


async def test_a_writer_that_dies_is_restarted_with_the_batch_it_held(db, monkeypatch):
    engine = create_async_engine(f"sqlite+aiosqlite:///{db}")
    writer = RecordWriter(engine, queue_size=1000, batch_size=4)
    monkeypatch.setattr("kvrelay.gateway.storage.writer._RESTART_DELAY_S", 0.01)
    real_write = writer._write
    died = []

    async def die_once(batch):
        if not died:
            died.append(len(batch))
            raise asyncio.CancelledError  # escapes every handler: the task ends
        await real_write(batch)

    monkeypatch.setattr(writer, "_write", die_once)
    writer.start()
    for i in range(10):
        writer.submit(record(i))
    await wait_for(lambda: writer.num_restarts == 1 and writer.num_written == 10)
    assert writer.alive
    await writer.close(timeout_s=10)
    await engine.dispose()
    assert ids(db) == [f"req-{i:04d}" for i in range(10)]


async def test_errors_that_may_pass_lose_nothing_even_when_they_persist(db, monkeypatch):
    """A full pool, a deadlock or a read-only failover arrive as plain DBAPI errors: the
    records wait for them, however long, and none is quarantined."""
    from sqlalchemy.exc import DBAPIError, TimeoutError as PoolTimeout

    engine = create_async_engine(f"sqlite+aiosqlite:///{db}")
    writer = RecordWriter(engine, queue_size=1000, batch_size=4)
    monkeypatch.setattr("kvrelay.gateway.storage.writer.asyncio.sleep", _no_wait)
    real_write = writer._write
    errors = iter([PoolTimeout("QueuePool limit reached")] * 7
                  + [DBAPIError("INSERT", {}, Exception("deadlock detected"))] * 9)

    async def flaky(batch):
        if (error := next(errors, None)) is not None:
            raise error
        await real_write(batch)

    monkeypatch.setattr(writer, "_write", flaky)
    writer.start()
    for i in range(10):
        writer.submit(record(i))
    await writer.close(timeout_s=10)
    await engine.dispose()
    assert (writer.num_written, writer.num_quarantined) == (10, 0)
    assert ids(db) == [f"req-{i:04d}" for i in range(10)]


async def test_a_lone_record_that_always_fails_does_not_hold_up_the_ones_behind_it(db, monkeypatch):
    engine = create_async_engine(f"sqlite+aiosqlite:///{db}")
    writer = RecordWriter(engine, queue_size=1000, batch_size=1)
    monkeypatch.setattr("kvrelay.gateway.storage.writer.asyncio.sleep", _no_wait)
    real_write = writer._write

    async def poison_first(batch):
        if any(r.id == "req-0000" for r in batch):
            raise OperationalError("INSERT", {}, Exception("fails only for this record"))
        await real_write(batch)

    monkeypatch.setattr(writer, "_write", poison_first)
    for i in range(5):
        writer.submit(record(i))
    writer.start()
    await writer.close(timeout_s=10)
    await engine.dispose()
    assert (writer.num_written, writer.num_quarantined) == (4, 1)
    assert ids(db) == [f"req-{i:04d}" for i in range(1, 5)]


async def test_records_submitted_within_the_linger_share_one_commit(db):
    """Requests answered a few ms apart (the usual load) are written in one transaction,
    not one each; a record alone waits only the linger."""
    from kvrelay.gateway.storage.engine import open_database

    engine = open_database(f"sqlite+aiosqlite:///{db}")
    writer = RecordWriter(engine, queue_size=10_000, batch_size=64, linger_s=0.3)
    batches: list[int] = []
    write = writer._write

    async def counted(batch):
        batches.append(len(batch))
        await write(batch)

    writer._write = counted  # type: ignore[method-assign]
    writer.start()
    try:
        for i in range(20):
            writer.submit(record(i, session=f"s{i % 3}"))
            await asyncio.sleep(0.005)
        await wait_for(lambda: writer.num_written == 20)
        assert batches == [20]
        started = time.monotonic()
        writer.submit(record(99))
        await wait_for(lambda: writer.num_written == 21)
        assert batches == [20, 1] and time.monotonic() - started < 2.0
    finally:
        await writer.close(timeout_s=10)
        await engine.dispose()
    assert len(ids(db)) == 21


async def test_a_sqlite_database_is_opened_in_write_ahead_logging(db):
    from sqlalchemy import text

    from kvrelay.gateway.storage.engine import open_database

    engine = open_database(f"sqlite+aiosqlite:///{db}")
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("PRAGMA synchronous"))).scalar() == 2  # FULL: a commit is on disk
    finally:
        await engine.dispose()
