"""StateStore: the inferred state saved to SQL in the background, and read back.

Memory is a bounded cache of SQL. Requests only mark what they changed (Inference.changes);
every `flush_interval_s` the store builds rows for what changed and upserts them in one
transaction, so a busy session costs one write per interval, not one per request, and
the request path never waits on the database. A failed save keeps its changes for the
next one. At start-up the sessions active within the TTL are rebuilt (so content
linking works at once); a session named by a request but no longer in memory is
rebuilt on demand (`restore`), so it continues with its rounds and placeholders.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import Column, Row, and_, delete, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.orm import InstrumentedAttribute

from kvrelay.gateway.inference import rows
from kvrelay.gateway.inference.planner import Inference
from kvrelay.gateway.inference.state import Changes, SessionState
from kvrelay.gateway.storage.dialect import upsert
from kvrelay.gateway.storage.models import Base, InferredAgentRow, InferredSessionRow, RoundRow, SegmentRow, StepEdgeRow

if TYPE_CHECKING:
    from sqlalchemy.sql.base import ReadOnlyColumnCollection

    from kvrelay.gateway.storage.dialect import DialectInsert

logger = logging.getLogger(__name__)

_RESTORE_TIMEOUT_S = 0.5  # a new session's first request waits at most this for the database
_RESTORE_BACKOFF_S = 5.0  # after a failed restore, skip restores this long (the database is likely down)


class _Saved(NamedTuple):
    """What a save covered of one session, marked saved once the transaction commits."""

    session: SessionState
    num_texts: int
    rounds: set[str]  # round ids


class LoadResult(NamedTuple):
    num_agents: int
    num_sessions: int
    num_segments: int


class StateStore:
    def __init__(self, engine: AsyncEngine, inference: Inference, flush_interval_s: float = 0.5) -> None:
        self._engine = engine
        self._inference = inference
        self._interval_s = flush_interval_s
        self._stopping = asyncio.Event()
        dialect = engine.dialect.name
        self._upserts: dict[type[Base], DialectInsert] = {
            table: upsert(dialect, table.__table__)
            for table in (InferredAgentRow, StepEdgeRow, InferredSessionRow, SegmentRow, RoundRow)}
        self._restores_paused_until = 0.0
        self.num_saves = 0
        self.num_save_errors = 0

    async def load(self) -> LoadResult:
        """Agents and step graphs of every app, and the sessions seen within the TTL."""
        inference = self._inference
        cutoff = datetime.now(UTC) - timedelta(seconds=inference.settings.session_ttl_s)
        async with self._engine.connect() as conn:
            # Oldest first: past max_agents per app, the least recently updated stay out.
            agents = (await conn.execute(select(InferredAgentRow.__table__)
                                         .order_by(InferredAgentRow.updated_at))).all()
            edges = (await conn.execute(select(StepEdgeRow.__table__))).all()
            sessions = (await conn.execute(select(InferredSessionRow.__table__)
                                           .where(InferredSessionRow.last_seen >= cutoff)
                                           .order_by(InferredSessionRow.last_seen))).all()
            live = InferredSessionRow.__table__.c
            segments = await _children(conn, SegmentRow, live, cutoff, SegmentRow.seq)
            rounds = await _children(conn, RoundRow, live, cutoff, RoundRow.round_id)
        for row in agents:
            rows.restore_agent(inference.app(row.app_id), row, inference.new_learner())
        for row in edges:
            rows.restore_edge(inference.app(row.app_id), row)
        for row in sessions:
            key = (row.app_id, row.session_id)
            rows.restore_session(inference.app(row.app_id), row, segments.get(key, []), rounds.get(key, []))
        return LoadResult(len(agents), len(sessions), sum(len(s) for s in segments.values()))

    async def restore(self, app_id: str, session_id: str) -> bool:
        """Rebuild one session from SQL unless it is in memory; False when there is none
        (or the database did not answer in time: the request then starts it afresh)."""
        if self._inference.has_session(app_id, session_id) or time.monotonic() < self._restores_paused_until:
            return False
        try:
            async with asyncio.timeout(_RESTORE_TIMEOUT_S), self._engine.connect() as conn:
                found = await self._read_session(conn, app_id, session_id)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            self._restores_paused_until = time.monotonic() + _RESTORE_BACKOFF_S
            logger.warning("could not restore session %s from the database (%s)", session_id, type(exc).__name__)
            return False
        if found is None or self._inference.has_session(app_id, session_id):
            return False
        rows.restore_session(self._inference.app(app_id), *found)
        return True

    async def sessions_named(self, session_id: str) -> list[str]:
        """The apps that have a session of this id in SQL."""
        async with self._engine.connect() as conn:
            result = await conn.execute(select(InferredSessionRow.app_id)
                                        .where(InferredSessionRow.session_id == session_id))
            return [app_id for (app_id,) in result]

    async def flush(self) -> int:
        """Save what changed since the last flush; the number of rows written."""
        changes = self._inference.changes.take()
        if not changes:
            return 0
        batch, advance = self._rows(changes)
        try:
            async with self._engine.begin() as conn:
                for app_id, session_id in sorted(changes.merged):  # merged into another session: gone
                    for table in (InferredSessionRow, SegmentRow, RoundRow):
                        await conn.execute(delete(table).where(table.app_id == app_id, table.session_id == session_id))
                for model, values in batch.items():
                    if values:
                        await conn.execute(self._upserts[model], values)
        except (SQLAlchemyError, OSError, asyncio.CancelledError):
            self._inference.changes.merge(changes)  # saved next time (upserts: a repeat is harmless)
            self.num_save_errors += 1
            raise
        for saved in advance:
            saved.session.num_saved_texts = max(saved.session.num_saved_texts, saved.num_texts)
            saved.session.rounds.unsaved -= saved.rounds
        self.num_saves += 1
        return sum(len(v) for v in batch.values())

    def stop(self) -> None:
        """Ask `run` to return after its current save. Cancelling it instead could cut a
        SQLite write short in aiosqlite's thread and leave the database locked for the
        final save."""
        self._stopping.set()

    async def run(self) -> None:
        """Flush until stopped; an outage delays saves (logged), it loses nothing still in memory."""
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)
            if self._stopping.is_set():
                return
            try:
                await self.flush()
            except (SQLAlchemyError, OSError) as exc:
                logger.warning("saving inferred state failed (%s); retrying", type(exc).__name__)

    def _rows(self, changes: Changes) -> tuple[dict[type[Base], list[rows.Row]], list[_Saved]]:
        now = datetime.now(UTC)
        batch: dict[type[Base], list[rows.Row]] = {t: [] for t in self._upserts}
        advance: list[_Saved] = []
        for app_id, agent_id in sorted(changes.agents):
            app = self._inference.apps.get(app_id)
            agent = app.agents.get(agent_id) if app else None
            if app is None or agent is None:
                continue
            node = app.graph.nodes.get(agent_id)
            batch[InferredAgentRow].append(rows.agent_row(app_id, agent, node, now))
            if node is not None:
                batch[StepEdgeRow] += rows.edge_rows(app_id, agent_id, node)
        for app_id, session_id in sorted(changes.sessions):
            app = self._inference.apps.get(app_id)
            session = app.sessions.get(session_id) if app else None
            if app is None or session is None:
                continue  # dropped from memory since: its last saved state stands
            batch[InferredSessionRow].append(rows.session_row(app_id, session))
            batch[SegmentRow] += rows.segment_rows(app, app_id, session, session.num_saved_texts, now)
            rounds = set(session.rounds.unsaved)
            batch[RoundRow] += rows.round_rows(app_id, session, rounds)
            advance.append(_Saved(session, session.next_seq(), rounds))
        return batch, advance

    async def _read_session(self, conn: AsyncConnection, app_id: str, session_id: str
                            ) -> tuple[Row[Any], Sequence[Row[Any]], Sequence[Row[Any]]] | None:
        row = (await conn.execute(select(InferredSessionRow.__table__).where(
            InferredSessionRow.app_id == app_id, InferredSessionRow.session_id == session_id))).first()
        if row is None:
            return None
        segments = (await conn.execute(select(SegmentRow.__table__).where(
            SegmentRow.app_id == app_id, SegmentRow.session_id == session_id).order_by(SegmentRow.seq))).all()
        rounds = (await conn.execute(select(RoundRow.__table__).where(
            RoundRow.app_id == app_id, RoundRow.session_id == session_id).order_by(RoundRow.round_id))).all()
        return row, segments, rounds


async def _children(conn: AsyncConnection, table: type[SegmentRow] | type[RoundRow],
                    live: ReadOnlyColumnCollection[str, Column[Any]], cutoff: datetime,
                    order: InstrumentedAttribute[Any]) -> dict[tuple[str, str], list[Row[Any]]]:
    """Rows of `table` that belong to sessions seen since `cutoff`, grouped by session."""
    query = (select(table.__table__)
             .join(InferredSessionRow.__table__, and_(live.app_id == table.app_id, live.session_id == table.session_id))
             .where(live.last_seen >= cutoff)
             .order_by(table.app_id, table.session_id, order))
    grouped: dict[tuple[str, str], list[Row[Any]]] = {}
    for row in (await conn.execute(query)).all():
        grouped.setdefault((row.app_id, row.session_id), []).append(row)
    return grouped
