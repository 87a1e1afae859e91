"""Gateway replicas that plan with what every replica observed: a shared, ordered log.

Each replica keeps its inferred state in memory (the request path never waits on a
database). What it learns from traffic is also appended to one table of the shared
database, `inference_observations`: a planned request (its identity, the prompt as
planning read it, and the session it was given), a completed answer, a session's home
upstream. Every replica applies what the others appended, in the log's order, to its
own state, as if it had handled those requests itself: a plan observation runs the
planner again on the same inputs with the session the origin chose (and no time
budget), an answer is remembered as if relayed, a home is settled. So a prompt that
quotes an answer another replica relayed gets its placeholder, and a session planned
by three replicas stays one session.

Why a log of inputs rather than a shared copy of the state: planning reads and writes
most of an app's state (texts, agents, prefixes, rounds, the step graph) on every
request; replaying its inputs keeps every structure consistent with one code path, and
costs each replica the planning of the others' requests (about a tenth of a request's
gateway CPU, measured in `kvrelay bench gateway`).

Staleness is the time from the origin's observation to its application elsewhere: the
appender's commit (a batch of whatever queued, written at once) plus the wake-up. On
PostgreSQL an append sends NOTIFY and replicas LISTEN (a read every second stays as a
fallback); on SQLite (replicas of one host sharing the file) an append rewrites a
doorbell file beside the database, which replicas read every `poll_interval_s`. It is measured per applied observation on the origin's and the
reader's wall clocks (exact on one host; across hosts it includes their clock offset)
and exported on /metrics. Appends hold a transaction-scoped advisory lock on
PostgreSQL, so sequence numbers commit in order and a reader's cursor never passes a
row still being written (SQLite serialises writers anyway).

What this does not make consistent: two replicas planning requests of one session at
the same moment each plan without the other's (up to the staleness); a replica started
later rebuilds from the saved state (StateStore) and then follows the log from its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy import delete, event, func, insert, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from kvrelay.gateway.storage.models import ObservationRow

logger = logging.getLogger(__name__)

ObservationKind = Literal["plan", "answer", "home"]
Apply = Callable[[str, dict[str, Any]], None]  # (kind, payload): raises KeyError/TypeError/ValueError on a bad one

CHANNEL = "kvrelay_observations"
_LOCK_KEY = 0x6B7672656C6179  # the advisory lock appends hold on PostgreSQL ("kvrelay")
_MAX_OUTBOX = 100_000  # observations waiting for the database; past it the oldest is dropped (counted)
_STALENESS_KEPT = 10_000  # recent staleness samples kept for the quantiles
_PRUNE_EVERY_S = 60.0


def _sqlite_log(database: str) -> AsyncEngine:
    """The engine of the log's own SQLite file. Its commits are not synced to disk
    (`synchronous=NORMAL`, safe in write-ahead logging but for a power cut): the log
    shares what replicas hold in memory and is not the record of anything."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{database}-observations")

    @event.listens_for(engine.sync_engine, "connect")
    def _unsynced(dbapi_connection: Any, _: Any) -> None:
        dbapi_connection.execute("PRAGMA synchronous=NORMAL")

    return engine


class Doorbell:
    """A few bytes in a file beside a SQLite database, rewritten after every append: the
    replicas of one host read it to learn that the log grew, since SQLite has no NOTIFY
    and the file's own timestamps are too coarse to tell two commits apart."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        return self._fd

    def ring(self) -> None:
        try:
            os.pwrite(self._open(), time.time_ns().to_bytes(8, "little"), 0)
        except OSError as exc:
            logger.warning("could not ring %s (%s); replicas read the log once a second", self.path, exc)

    def read(self) -> bytes:
        try:
            return os.pread(self._open(), 8, 0)
        except OSError:
            return b""

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SharedLog:
    """Appends this replica's observations and applies the others', in the log's order.

    Contract: `publish` never blocks and never raises; `append_loop` and `tail_loop` run
    until cancelled and survive any database outage (an append waits and retries, a read
    retries from the same cursor), so an outage delays sharing but loses nothing still in
    memory. An observation that cannot be applied (a row another version wrote) is
    skipped, logged and counted; it stops nothing."""

    def __init__(self, engine: AsyncEngine, replica_id: str, apply: Apply, poll_interval_s: float = 0.05,
                 retention_s: float = 3600.0, batch_size: int = 512) -> None:
        database = engine.url.database if engine.dialect.name == "sqlite" else None
        self._sqlite_file = database if database and database != ":memory:" else None
        # SQLite: the log is a file of its own beside the database, so an append never
        # queues behind the record writer's or the state saver's transactions (measured:
        # in one file, appends under load took 21 ms at p50 and 141 ms at p90).
        self._engine = _sqlite_log(self._sqlite_file) if self._sqlite_file else engine
        self.replica_id = replica_id
        self._apply = apply
        self._poll_s = poll_interval_s
        self._retention_s = retention_s
        self._batch = batch_size
        self._postgres = engine.dialect.name == "postgresql"
        self._doorbell = Doorbell(f"{self._sqlite_file}-observations.bell") if self._sqlite_file else None
        self._rung = b""
        self._reading = asyncio.Lock()
        self._outbox: deque[tuple[int, dict[str, Any]]] = deque()  # (ticket, row), waiting for the appender
        self._sending: list[tuple[int, dict[str, Any]]] = []  # the batch being appended, kept until it commits
        self._queued = asyncio.Event()
        self._arrived = asyncio.Event()  # NOTIFY came (PostgreSQL)
        self._appended = asyncio.Condition()
        self._listener: AsyncConnection | None = None
        self.cursor: int | None = None  # the last seq read; None until `start`
        self.staleness_ms: deque[float] = deque(maxlen=_STALENESS_KEPT)
        self.num_published = self.num_appended = self.num_applied = 0
        self.num_dropped = self.num_apply_errors = self.num_append_errors = self.num_read_errors = 0
        self.num_catch_up_misses = self.num_append_waits_missed = 0  # barrier waits cut by their bound

    # -- this replica's observations ------------------------------------------------------
    def publish(self, kind: ObservationKind, payload: dict[str, Any]) -> int:
        """Queue an observation for the log; its ticket, for `appended`."""
        if len(self._outbox) >= _MAX_OUTBOX:
            self._outbox.popleft()
            self.num_dropped += 1
            logger.error("replication outbox full; dropped the oldest observation")
        self.num_published += 1
        self._outbox.append((self.num_published, {"replica": self.replica_id, "kind": kind,
                                                  "payload": json.dumps(payload), "observed_at": time.time()}))
        self._queued.set()
        return self.num_published

    @property
    def engine(self) -> AsyncEngine:
        """Where the log is: the database's engine, or on SQLite its own file's."""
        return self._engine

    @property
    def backlog(self) -> int:
        return len(self._outbox) + len(self._sending)

    def _oldest_pending(self) -> int:
        """The ticket of the oldest observation not yet committed (past every one when none)."""
        pending = self._sending or self._outbox
        return pending[0][0] if pending else self.num_published + 1

    async def append_loop(self) -> None:
        delay = 0.05
        while True:
            if not self._sending:
                await self._queued.wait()
                self._queued.clear()
            while self._sending or self._outbox:
                if not self._sending:
                    self._sending = [self._outbox.popleft() for _ in range(min(self._batch, len(self._outbox)))]
                try:
                    await self._append([row for _, row in self._sending])
                except (SQLAlchemyError, OSError) as exc:
                    self.num_append_errors += 1
                    logger.warning("sharing %d observations failed (%s); retrying in %.2fs", len(self._sending),
                                   type(exc).__name__, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                delay = 0.05
                self.num_appended += len(self._sending)
                self._sending = []
                async with self._appended:
                    self._appended.notify_all()

    async def _append(self, batch: list[dict[str, Any]]) -> None:
        now = datetime.now(UTC)
        rows = [{**row, "created_at": now} for row in batch]
        async with self._engine.begin() as conn:
            if self._postgres:  # seqs commit in order: a reader never skips one still being written
                await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
            await conn.execute(insert(ObservationRow.__table__), rows)
            if self._postgres:
                await conn.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})
        if self._doorbell is not None:
            self._doorbell.ring()

    async def appended(self, ticket: int, timeout_s: float) -> bool:
        """Wait until the observation of `ticket` (and every one before it) is committed,
        at most `timeout_s`; whether it was."""
        async def wait() -> None:
            async with self._appended:
                await self._appended.wait_for(lambda: self._oldest_pending() > ticket)
        try:
            await asyncio.wait_for(wait(), timeout_s)
            return True
        except TimeoutError:
            self.num_append_waits_missed += 1
            return False

    async def drained(self, timeout_s: float) -> bool:
        """Wait until everything published so far is in the database (shutdown, tests)."""
        async def wait() -> None:
            async with self._appended:
                await self._appended.wait_for(lambda: not self._outbox and not self._sending)
        try:
            await asyncio.wait_for(wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    # -- the others' ----------------------------------------------------------------------
    async def start(self) -> None:
        """Follow the log from its current end (what came before is in the saved state).
        On SQLite the log's own file is created if missing, in write-ahead logging: the
        replicas' processes read and write it, and in SQLite's default mode a reader
        blocks every writer."""
        if self._sqlite_file is not None:
            async with self._engine.connect() as conn:
                await conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            async with self._engine.begin() as conn:
                await conn.run_sync(lambda sync: ObservationRow.__table__.create(sync, checkfirst=True))
        async with self._engine.connect() as conn:
            self.cursor = (await conn.execute(select(func.max(ObservationRow.seq)))).scalar() or 0

    async def tail_loop(self) -> None:
        if self.cursor is None:
            await self.start()
        last_prune = 0.0
        while True:
            if self._postgres and self._listener is None:
                await self._listen()
            try:
                applied = await self.read_once()
            except (SQLAlchemyError, OSError) as exc:
                self.num_read_errors += 1
                logger.warning("reading shared observations failed (%s); retrying", type(exc).__name__)
                await self._close_listener()
                await asyncio.sleep(1.0)
                continue
            if time.monotonic() - last_prune > _PRUNE_EVERY_S:
                last_prune = time.monotonic()
                await self._prune()
            if applied < self._batch:
                await self._next_change()

    async def _next_change(self) -> None:
        """Until the log may hold more: NOTIFY on PostgreSQL (or a second's wait); on
        SQLite, the doorbell file read every `poll_interval_s` (a read of a few bytes,
        where a query costs a fraction of a millisecond), and at least once a second."""
        if self._postgres:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), 1.0)
            self._arrived.clear()
            return
        waited = 0.0
        while waited < 1.0:
            await asyncio.sleep(self._poll_s)
            waited += self._poll_s
            if self._doorbell is not None and self._doorbell.read() != self._rung:
                return

    def has_news(self) -> bool:
        """Whether the log may hold rows not read yet: on SQLite, a doorbell rung since
        the last read began (a read of a few bytes). On PostgreSQL always: a NOTIFY may
        still be on its way when the request it should precede arrives, so only a read
        of the log (one indexed query) can tell."""
        if self._doorbell is not None:
            return self._doorbell.read() != self._rung
        return True

    async def catch_up(self, timeout_s: float) -> bool:
        """Apply what the log holds before going on, when it has news, at most
        `timeout_s`: called before planning, so a prompt quoting an answer another replica
        committed before its client had it is planned with that answer. Whether it
        caught up (False: timed out or the database failed; planning goes on)."""
        if not self.has_news() and not self._reading.locked():
            return True
        try:
            async with asyncio.timeout(timeout_s):
                async with self._reading:  # a read under way (the tail loop's) is applied first
                    pass
                full = False
                while full or self.has_news():
                    full = await self.read_once() == self._batch
            return True
        except (TimeoutError, SQLAlchemyError, OSError) as exc:
            self.num_catch_up_misses += 1
            logger.debug("catching up with the shared log failed (%s)", type(exc).__name__)
            return False

    async def read_once(self) -> int:
        """Apply the next batch of the others' observations; how many rows were read.
        One read at a time (the tail loop's and a request's catch-up), so no row is
        applied twice."""
        async with self._reading:
            if self._doorbell is not None:
                self._rung = self._doorbell.read()  # before the read: a ring during it is not missed
            return await self._read_batch()

    async def _read_batch(self) -> int:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(
                select(ObservationRow.seq, ObservationRow.replica, ObservationRow.kind, ObservationRow.payload,
                       ObservationRow.observed_at)
                .where(ObservationRow.seq > (self.cursor or 0)).order_by(ObservationRow.seq).limit(self._batch))).all()
        for seq, replica, kind, payload, observed_at in rows:
            self.cursor = seq
            if replica == self.replica_id:
                continue
            try:
                self._apply(kind, json.loads(payload))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                self.num_apply_errors += 1
                logger.error("shared observation %d (%s from %s) not applied: %s", seq, kind, replica, exc)
                continue
            self.num_applied += 1
            self.staleness_ms.append(max(0.0, (time.time() - observed_at) * 1e3))
        return len(rows)

    async def _listen(self) -> None:
        """LISTEN on a connection of its own; on failure the loop polls and tries again."""
        conn: AsyncConnection | None = None
        try:
            conn = await self._engine.connect()
            driver = (await conn.get_raw_connection()).driver_connection
            if driver is None:
                raise AttributeError("no driver connection")
            await driver.add_listener(CHANNEL, self._notified)
        except (SQLAlchemyError, OSError, AttributeError) as exc:
            logger.warning("LISTEN %s failed (%s); polling", CHANNEL, type(exc).__name__)
            if conn is not None:
                with contextlib.suppress(SQLAlchemyError, OSError):
                    await conn.close()
            return
        self._listener = conn

    def _notified(self, *_: Any) -> None:
        self._arrived.set()

    async def _close_listener(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            with contextlib.suppress(SQLAlchemyError, OSError):
                await listener.close()

    async def _prune(self) -> None:
        cutoff = datetime.now(UTC) - timedelta(seconds=self._retention_s)
        try:
            async with self._engine.begin() as conn:
                await conn.execute(delete(ObservationRow).where(ObservationRow.created_at < cutoff))
        except (SQLAlchemyError, OSError) as exc:
            logger.warning("pruning shared observations failed (%s)", type(exc).__name__)

    async def close(self) -> None:
        await self._close_listener()
        if self._doorbell is not None:
            self._doorbell.close()
        if self._sqlite_file is not None:
            await self._engine.dispose()

    def staleness_quantile(self, q: float) -> float | None:
        if not self.staleness_ms:
            return None
        ordered = sorted(self.staleness_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
