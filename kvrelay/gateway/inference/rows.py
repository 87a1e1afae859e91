"""The inferred state as SQL rows and back: agents, step-graph edges, sessions, segments, rounds.

Rows are plain dicts for Core executemany (see StateStore). Going back, a session is
rebuilt whole: its texts re-enter the app's TextIndex, so placeholders in its next
prompts are found as if the gateway had never stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from kvrelay.gateway.inference.agenttable import AgentState
from kvrelay.gateway.inference.prefix import PrefixLearner
from kvrelay.gateway.inference.rounds import RoundState
from kvrelay.gateway.inference.state import MAX_INNER_KEPT, AppState, KnownText, SessionState, TextRef
from kvrelay.gateway.inference.stepgraph import StepNode
from kvrelay.json_codec import dumps_text

Row = dict[str, Any]


def agent_row(app_id: str, agent: AgentState, node: StepNode | None, now: datetime) -> Row:
    fixed = agent.prefix.fixed
    return {"app_id": app_id, "agent_id": agent.id, "model": agent.model,
            "prefix_candidate": agent.prefix.candidate, "prefix_hits": agent.prefix.hits,
            "fixed_prefix_chars": len(fixed) if fixed else 0,
            "waited_all": node.waited_all if node else 0, "waited_some": node.waited_some if node else 0,
            "name": agent.name, "composed_reads": agent.composed_reads, "transcript_reads": agent.transcript_reads,
            "updated_at": now}


def edge_rows(app_id: str, target: str, node: StepNode) -> list[Row]:
    return [{"app_id": app_id, "target": target, "source": source, "kind": kind, "count": count}
            for kind, counter in (("dataflow", node.dataflow), ("succession", node.succession))
            for source, count in counter.items()]


def session_row(app_id: str, session: SessionState) -> Row:
    series = {"responses": session.responses, "tools": session.tools,
              "read_by": {agent: sorted(seqs) for agent, seqs in session.read_by.items()},
              "call_ids": session.call_ids, "members": sorted(session.members),
              "pass": sorted(session.rounds.pass_agents), "last_pass": sorted(session.rounds.last_pass)}
    return {"app_id": app_id, "session_id": session.id, "num_requests": session.num_requests,
            "question_seq": session.question_seq, "last_agent": session.last_agent,
            "series": dumps_text(series), "last_round_size": len(session.rounds.last_pass) or None,
            "current_round": session.rounds.current_id,
            "first_seen": session.first_seen_at, "last_seen": session.last_seen_at}


def segment_rows(app: AppState, app_id: str, session: SessionState, start: int, now: datetime) -> list[Row]:
    rows = []
    for seq in range(start, session.next_seq()):
        known = session.texts[seq]
        text = app.index.text_of(TextRef(session.id, seq))
        if text is None:
            raise LookupError(f"text {seq} of session {session.id} is not indexed")
        rows.append({"app_id": app_id, "session_id": session.id, "seq": seq, "kind": known.kind,
                     "agent_id": known.agent_id, "request_id": known.request_id,
                     "content_hash": known.content_hash, "text": text, "created_at": now})
    return rows


def round_rows(app_id: str, session: SessionState, ids: set[str]) -> list[Row]:
    rounds = session.rounds.rounds
    return [{"app_id": app_id, "session_id": session.id, "round_id": round_id,
             "outputs": dumps_text(sorted(rounds[round_id].reads)), "expected": rounds[round_id].expected,
             "num_requests": rounds[round_id].num_requests} for round_id in sorted(ids)]


def restore_agent(app: AppState, row: Any, learner: PrefixLearner) -> None:
    """An agent saved in SQL, as the app's most recently used (rows come oldest first, so
    past `max_agents` the longest unused stay out)."""
    learner.candidate, learner.hits = row.prefix_candidate, row.prefix_hits
    app.agents.add(AgentState(row.agent_id, row.model, learner, row.name, row.composed_reads, row.transcript_reads))
    app.graph.restore_waits(row.agent_id, row.waited_all, row.waited_some)


def restore_edge(app: AppState, row: Any) -> None:
    """A step-graph edge saved in SQL, kept only between agents in memory (the graph's
    nodes are the app's agents)."""
    if row.target in app.agents and row.source in app.agents:
        app.graph.restore_edge(row.target, row.source, row.kind, row.count)


def restore_session(app: AppState, row: Any, segments: Sequence[Any], rounds: Sequence[Any]) -> SessionState:
    """Rebuild a session and index its texts; `segments` in seq order."""
    session = SessionState(row.session_id, _monotonic(row.last_seen), first_seen=_aware(row.first_seen).timestamp())
    series = json.loads(row.series)
    session.responses = {agent: list(seqs) for agent, seqs in series["responses"].items()}
    session.tools = {agent: list(seqs) for agent, seqs in series["tools"].items()}
    session.read_by = {agent: set(seqs) for agent, seqs in series["read_by"].items()}
    session.call_ids = list(series.get("call_ids", []))
    session.members = set(series.get("members", session.read_by))
    session.rounds.pass_agents = set(series.get("pass", []))
    session.num_requests, session.question_seq, session.last_agent = row.num_requests, row.question_seq, row.last_agent
    for segment in segments:
        if segment.seq != session.next_seq():
            break  # a gap: later texts could not be numbered the same again
        app.index.add(segment.text, TextRef(session.id, segment.seq))
        if len(segment.text) < app.index.anchor_chars:
            session.inner = [*session.inner[-MAX_INNER_KEPT + 1:], segment.seq]
        session.texts[segment.seq] = KnownText(segment.kind, segment.agent_id, segment.request_id,
                                               segment.content_hash)
    session.num_saved_texts = session.next_seq()
    for r in sorted(rounds, key=lambda r: _round_number(r.round_id)):
        session.rounds.rounds[r.round_id] = RoundState(r.round_id, r.expected, r.num_requests,
                                                       frozenset(json.loads(r.outputs)))
    session.rounds.last_pass = set(series.get("last_pass", []))
    session.rounds.current_id = row.current_round if row.current_round in session.rounds.rounds else None
    app.adopt(session)
    return session


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)  # SQLite drops the zone


def _monotonic(wall: datetime) -> float:
    return time.monotonic() - max(0.0, time.time() - _aware(wall).timestamp())


def _round_number(round_id: str) -> int:
    """The n of `<session>/r<n>`, so rounds come back in the order they formed."""
    number = round_id.rpartition("/r")[2]
    return int(number) if number.isdigit() else 0
