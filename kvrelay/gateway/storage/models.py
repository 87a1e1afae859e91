"""SQL records: sessions, agents and proxied requests.

Prompt and completion text are not stored unless `store_content` is on: by default a
request row keeps only a sha256 and a length of each.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, ClassVar

from sqlalchemy import Boolean, DateTime, Float, ForeignKey, Integer, Table
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kvrelay.gateway.storage.types import StorableString, StorableText


class Base(DeclarativeBase):
    if TYPE_CHECKING:
        __table__: ClassVar[Table]  # every model here declares __tablename__, so gets a Table


class SessionRow(Base):
    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class AgentRow(Base):
    __tablename__ = "agents"

    id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"), index=True)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RequestRow(Base):
    __tablename__ = "requests"

    id: Mapped[str] = mapped_column(StorableString(64), primary_key=True)
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"), index=True)
    agent_id: Mapped[str | None] = mapped_column(ForeignKey("agents.id"), index=True)
    endpoint: Mapped[str] = mapped_column(StorableString(64))
    model: Mapped[str | None] = mapped_column(StorableString(256))
    upstream: Mapped[str | None] = mapped_column(StorableString(512))
    stream: Mapped[bool] = mapped_column(Boolean)
    status: Mapped[str] = mapped_column(StorableString(32), index=True)
    http_status: Mapped[int] = mapped_column(Integer)
    error_type: Mapped[str | None] = mapped_column(StorableString(64))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float] = mapped_column(Float)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    first_token_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    prompt_sha256: Mapped[str] = mapped_column(StorableString(64))
    prompt_chars: Mapped[int] = mapped_column(Integer)
    completion_sha256: Mapped[str | None] = mapped_column(StorableString(64))
    completion_chars: Mapped[int | None] = mapped_column(Integer)
    prompt_text: Mapped[str | None] = mapped_column(StorableText)
    completion_text: Mapped[str | None] = mapped_column(StorableText)
    api_key_id: Mapped[str | None] = mapped_column(StorableString(32), index=True)
    plan: Mapped[str | None] = mapped_column(StorableText)
    ttft_breakdown: Mapped[str | None] = mapped_column(StorableText)  # the engine's kvrelay_ttft report, JSON


class ApiKeyRow(Base):
    """A client API key. Only its sha256 is stored: the secret is shown once, at creation."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(StorableString(32), primary_key=True)
    name: Mapped[str] = mapped_column(StorableString(128))
    prefix: Mapped[str] = mapped_column(StorableString(16))  # the secret's first characters, to recognise it
    sha256: Mapped[str] = mapped_column(StorableString(64), unique=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


# What the gateway inferred from traffic (gateway.inference), keyed by app so two apps
# with the same agent names stay apart. The in-memory state is a bounded cache of these
# rows; they let a restarted gateway continue its sessions.


class InferredAgentRow(Base):
    __tablename__ = "inference_agents"

    app_id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    agent_id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    model: Mapped[str] = mapped_column(StorableString(256))
    prefix_candidate: Mapped[str | None] = mapped_column(StorableText)  # the fixed system prefix being learned
    prefix_hits: Mapped[int] = mapped_column(Integer)
    fixed_prefix_chars: Mapped[int] = mapped_column(Integer)  # 0 until the prefix is confirmed
    waited_all: Mapped[int] = mapped_column(Integer)  # step-graph triggers (see StepGraph)
    waited_some: Mapped[int] = mapped_column(Integer)
    name: Mapped[str | None] = mapped_column(StorableString(128))  # what the traffic calls it, once seen
    composed_reads: Mapped[int] = mapped_column(Integer, default=0)  # round evidence (kvrelay/gateway/inference/rounds.py)
    transcript_reads: Mapped[int] = mapped_column(Integer, default=0)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class StepEdgeRow(Base):
    __tablename__ = "inference_edges"

    app_id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    target: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    source: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    kind: Mapped[str] = mapped_column(StorableString(16), primary_key=True)  # dataflow | succession
    count: Mapped[int] = mapped_column(Integer)


class InferredSessionRow(Base):
    __tablename__ = "inference_sessions"

    app_id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    num_requests: Mapped[int] = mapped_column(Integer)
    question_seq: Mapped[int | None] = mapped_column(Integer)
    last_agent: Mapped[str | None] = mapped_column(StorableString(128))
    series: Mapped[str] = mapped_column(StorableText)  # JSON: responses, tools and reads per agent (segment seqs)
    last_round_size: Mapped[int | None] = mapped_column(Integer)
    current_round: Mapped[str | None] = mapped_column(StorableString(160))
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class SegmentRow(Base):
    """A text of a session found again in later prompts: an agent's response, a tool
    result, the user question or a recurring block. The text itself is kept (it is what
    a later prompt is matched against); `content_hash` is what the engine keys KV by."""

    __tablename__ = "inference_segments"

    app_id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(StorableString(16))  # response | tool | question | block
    agent_id: Mapped[str | None] = mapped_column(StorableString(128))
    request_id: Mapped[str] = mapped_column(StorableString(64))
    content_hash: Mapped[str] = mapped_column(StorableString(64))
    text: Mapped[str] = mapped_column(StorableText)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RoundRow(Base):
    __tablename__ = "inference_rounds"

    app_id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(StorableString(128), primary_key=True)
    round_id: Mapped[str] = mapped_column(StorableString(160), primary_key=True)
    outputs: Mapped[str] = mapped_column(StorableText)  # JSON list of the segment seqs every member read
    expected: Mapped[int] = mapped_column(Integer)
    num_requests: Mapped[int] = mapped_column(Integer)


class ObservationRow(Base):
    """What one gateway replica learned from traffic, for the others to apply
    (kvrelay/gateway/inference/replication.py). Append-only; `seq` is the log's order."""

    __tablename__ = "inference_observations"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    replica: Mapped[str] = mapped_column(StorableString(64))
    kind: Mapped[str] = mapped_column(StorableString(16))  # plan | answer | home
    payload: Mapped[str] = mapped_column(StorableText)  # JSON
    observed_at: Mapped[float] = mapped_column(Float)  # the origin's wall clock, epoch seconds
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
