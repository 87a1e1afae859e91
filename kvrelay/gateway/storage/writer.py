"""Request records leave the request path through a bounded queue and reach SQL in batches.

While the database is down the writer keeps its current batch and retries with backoff,
and new records wait in the queue, so an outage delays records but loses none (unless
the queue itself overflows, which is counted and logged). A record the database refuses
is quarantined alone; the writer itself is supervised (RecordWriter).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, ProgrammingError, SQLAlchemyError, StatementError
from sqlalchemy.ext.asyncio import AsyncEngine

from kvrelay.gateway.storage.dialect import dialect_insert
from kvrelay.gateway.storage.models import AgentRow, RequestRow, SessionRow
from kvrelay.gateway.supervisor import SupervisedTask

if TYPE_CHECKING:
    from kvrelay.gateway.storage.journal import RecordJournal

logger = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    id: str
    endpoint: str
    stream: bool
    started_at: datetime
    finished_at: datetime
    latency_ms: float
    status: str  # ok | client_error | rate_limited | upstream_error | timeout | cancelled | unavailable
    http_status: int
    prompt_sha256: str
    prompt_chars: int
    session_id: str | None = None
    agent_id: str | None = None
    model: str | None = None
    upstream: str | None = None
    error_type: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_ms: float | None = None
    first_token_at: datetime | None = None
    completion_sha256: str | None = None
    completion_chars: int | None = None
    prompt_text: str | None = None
    completion_text: str | None = None
    api_key_id: str | None = None
    plan: str | None = None  # the SegmentPlan as JSON: offsets, kinds, names and hashes, no text
    ttft_breakdown: str | None = None  # the engine's TTFT breakdown (kv_transfer_params["kvrelay_ttft"]), JSON


def sha256_text(value: str) -> str:
    """Never raises: a lone surrogate (from an upstream's answer) hashes as its code point."""
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


# Errors that say a record can never be written (bad data, a constraint, a value the
# driver cannot bind, a bug of ours). Every other database or OS error may pass (a lost
# connection, a full pool, a lock, a deadlock, a failover): the records wait for it.
_REFUSALS = (DataError, IntegrityError, ProgrammingError)
_TRIES_BEFORE_SPLIT = 5  # failures in a row before the records are tried one by one
_STRIKES = 3  # times a record fails alone while others are written before it is quarantined


def _refused(exc: Exception) -> bool:
    if isinstance(exc, _REFUSALS):
        return True
    if isinstance(exc, StatementError) and not isinstance(exc, DBAPIError):
        return True  # raised while binding a value, before the database saw anything
    return not isinstance(exc, (SQLAlchemyError, OSError, TimeoutError))


_RESTART_DELAY_S = 1.0


class RecordWriter:
    """Writes request records in batches, and never stops while the gateway runs.

    A batch the database refuses is written again one record at a time, and a record it
    still refuses is quarantined: logged with its id and counted, never retried, so one
    bad record costs only itself. An outage keeps the batch and retries with backoff; an
    error that persists is also tried record by record, and a record that still fails
    while others are written is quarantined. Should the task end anyway (a bug), it is restarted with the batch it
    held (kvrelay/gateway/supervisor.py), and `alive` says so in the meantime (`/ready`)."""

    def __init__(self, engine: AsyncEngine, queue_size: int, batch_size: int,
                 journal: RecordJournal | None = None, linger_s: float = 0.0) -> None:
        self._engine = engine
        self._linger_s = linger_s  # a batch's first record waits this long for others
        self._journal = journal  # records not yet in SQL, on local disk (journal.py)
        self._queue: asyncio.Queue[RequestRecord] = asyncio.Queue(maxsize=queue_size)
        self._batch_size = batch_size
        insert = dialect_insert(engine.dialect.name)
        self._insert_session = insert(SessionRow.__table__).on_conflict_do_nothing()
        self._insert_agent = insert(AgentRow.__table__).on_conflict_do_nothing()
        self._insert_request = insert(RequestRow.__table__).on_conflict_do_nothing()
        self._runner: SupervisedTask | None = None
        self._held: list[RequestRecord] = []  # the batch being written, kept across a restart
        self._strikes: dict[str, int] = {}  # record id -> times it failed alone while others were written
        self.num_written = 0
        self.num_dropped = 0
        self.num_write_errors = 0
        self.num_quarantined = 0

    def submit(self, record: RequestRecord) -> None:
        """Never blocks the request path; on overflow the oldest record is dropped."""
        if self._queue.full():
            self._queue.get_nowait()
            self._queue.task_done()
            self.num_dropped += 1
            logger.error("record queue full; dropped the oldest request record")
        if self._journal is not None:
            self._journal.append(record)
        self._queue.put_nowait(record)

    @property
    def backlog(self) -> int:
        return self._queue.qsize() + len(self._held)

    @property
    def alive(self) -> bool:
        return self._runner is not None and self._runner.alive

    @property
    def num_restarts(self) -> int:
        return self._runner.num_restarts if self._runner is not None else 0

    def start(self) -> None:
        """Start writing; with a journal, first re-queue what a killed process left in it."""
        if self._journal is not None:
            leftovers = self._journal.leftovers()
            for record in leftovers:
                self.submit(record)
            self._journal.forget_leftovers()
            if leftovers:
                logger.warning("re-queued %d request records a previous process journaled", len(leftovers))
        self._runner = SupervisedTask("kvrelay-record-writer", self._run, _RESTART_DELAY_S)
        self._runner.start()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Drain what is queued (bounded by timeout_s), then stop."""
        if self._runner is None:
            return
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
        except TimeoutError:
            logger.error("record writer did not drain in %.0fs; %d records not written", timeout_s, self.backlog)
        await self._runner.stop()
        if self._journal is not None:
            self._journal.close()

    async def _run(self) -> None:
        while True:
            if not self._held:
                self._held = [await self._queue.get()]
                if self._linger_s and self._queue.qsize() < self._batch_size - 1:
                    # A commit costs about as much for one record as for hundreds: wait for
                    # the others of a busy moment. Records still leave in their order.
                    await asyncio.sleep(self._linger_s)
                while len(self._held) < self._batch_size and not self._queue.empty():
                    self._held.append(self._queue.get_nowait())
            try:
                await self._write_held()
            except Exception:
                # _write_held handles every database error; what is left is a bug of ours.
                logger.exception("writing %d records failed unexpectedly; quarantining them", len(self._held))
                for record in self._held:
                    self._quarantine(record, "writer_bug")
            batch, self._held = self._held, []
            if self._journal is not None:
                self._journal.done(len(batch))
            for _ in batch:
                self._queue.task_done()

    async def _write_held(self) -> None:
        """Write the held batch. Through an outage: retry with backoff, as long as it
        takes. After errors that persist, or one that says a record is refused: one
        record at a time, so the database itself tells which records are at fault."""
        todo = list(self._held)
        delay, failures = 0.2, 0
        while todo:
            try:
                await self._write(todo)
                self.num_written += len(todo)
                return
            except Exception as exc:
                error = exc
            if not _refused(error):
                self.num_write_errors += 1
                failures += 1
                if failures < _TRIES_BEFORE_SPLIT:
                    logger.warning("writing %d records failed (%s); retrying in %.1fs", len(todo),
                                   type(error).__name__, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                if len(todo) == 1 and not self._queue.empty():
                    todo.append(self._hold_one_more())  # another record shows whether writes go through
            logger.error("%d records failed (%s); writing them one by one", len(todo), type(error).__name__)
            todo, failures = await self._one_by_one(todo), 0
            if todo:  # nothing could be written: an outage after all
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _one_by_one(self, records: list[RequestRecord]) -> list[RequestRecord]:
        """Write each record alone; quarantine those refused. The ones that failed as in
        an outage come back to be retried; one that keeps failing while others are
        written (`_STRIKES` times) is at fault itself and is quarantined."""
        stuck: list[tuple[RequestRecord, Exception]] = []
        written = 0
        for record in records:
            try:
                await self._write([record])
                written += 1
                self._strikes.pop(record.id, None)
            except Exception as exc:
                if _refused(exc):
                    self._quarantine(record, type(exc).__name__)
                else:
                    stuck.append((record, exc))
        self.num_written += written
        if not written:
            return [record for record, _ in stuck]
        retry = []
        for record, error in stuck:
            self._strikes[record.id] = strikes = self._strikes.get(record.id, 0) + 1
            if strikes >= _STRIKES:
                self._quarantine(record, type(error).__name__)
            else:
                retry.append(record)
        return retry

    def _hold_one_more(self) -> RequestRecord:
        record = self._queue.get_nowait()
        self._held.append(record)  # marked done with the rest of the held batch
        return record

    def _quarantine(self, record: RequestRecord, error: str) -> None:
        self._strikes.pop(record.id, None)
        self.num_quarantined += 1
        logger.error("request record %s quarantined: the database refused it (%s)", record.id, error)

    async def _write(self, batch: list[RequestRecord]) -> None:
        """One transaction per batch. Statements on the Core tables run as executemany:
        compiled once and cached, where a multi-VALUES insert of ORM entities was
        recompiled for every batch (profiled: most of the writer's CPU)."""
        sessions = {r.session_id: r.started_at for r in reversed(batch) if r.session_id}
        agents = {r.agent_id: (r.session_id, r.started_at) for r in reversed(batch) if r.agent_id}
        async with self._engine.begin() as conn:
            if sessions:
                await conn.execute(self._insert_session, [{"id": k, "first_seen": v} for k, v in sessions.items()])
            if agents:
                await conn.execute(self._insert_agent,
                                   [{"id": k, "session_id": s, "first_seen": t} for k, (s, t) in agents.items()])
            await conn.execute(self._insert_request, [vars(r) for r in batch])  # flat scalars: no deep copy
