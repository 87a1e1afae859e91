"""Request records leave the request path through a bounded queue and reach SQL in batches.

While the database is down the writer keeps its current batch and retries with backoff,
and new records wait in the queue, so an outage delays records but loses none (unless
the queue itself overflows, which is counted and logged).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.storage.dialect import dialect_insert
from gateway.storage.models import AgentRow, RequestRow, SessionRow

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


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class RecordWriter:
    def __init__(self, engine: AsyncEngine, queue_size: int, batch_size: int) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[RequestRecord] = asyncio.Queue(maxsize=queue_size)
        self._batch_size = batch_size
        insert = dialect_insert(engine.dialect.name)
        self._insert_session = insert(SessionRow.__table__).on_conflict_do_nothing()
        self._insert_agent = insert(AgentRow.__table__).on_conflict_do_nothing()
        self._insert_request = insert(RequestRow.__table__).on_conflict_do_nothing()
        self._task: asyncio.Task[None] | None = None
        self.num_written = 0
        self.num_dropped = 0
        self.num_write_errors = 0
        self.num_rejected = 0

    def submit(self, record: RequestRecord) -> None:
        """Never blocks the request path; on overflow the oldest record is dropped."""
        if self._queue.full():
            self._queue.get_nowait()
            self._queue.task_done()
            self.num_dropped += 1
            logger.error("record queue full; dropped the oldest request record")
        self._queue.put_nowait(record)

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvrelay-record-writer")

    async def close(self, timeout_s: float = 10.0) -> None:
        """Drain what is queued (bounded by timeout_s), then stop."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
        except TimeoutError:
            logger.error("record writer did not drain in %.0fs; %d records not written", timeout_s, self.backlog)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._write_until_done(batch)
            for _ in batch:
                self._queue.task_done()

    async def _write_until_done(self, batch: list[RequestRecord]) -> None:
        delay = 0.2
        while True:
            try:
                await self._write(batch)
                self.num_written += len(batch)
                return
            except (DataError, IntegrityError, ProgrammingError) as exc:
                # Not an outage: some row can never be written. Write the rest one by one
                # so one bad row cannot wedge every later record.
                logger.error("a batch of %d records was rejected (%s); writing them one by one",
                             len(batch), type(exc).__name__)
                await self._write_one_by_one(batch)
                return
            except (SQLAlchemyError, OSError) as exc:
                self.num_write_errors += 1
                logger.warning("writing %d records failed (%s); retrying in %.1fs", len(batch), type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _write_one_by_one(self, batch: list[RequestRecord]) -> None:
        for record in batch:
            try:
                await self._write([record])
                self.num_written += 1
            except (DataError, IntegrityError, ProgrammingError) as exc:
                self.num_rejected += 1
                logger.error("request record %s rejected by the database: %s", record.id, type(exc).__name__)

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

