"""inferred multi-agent state: agents, step-graph edges, sessions, segments, rounds

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _key(name: str, length: int = 128) -> sa.Column[str]:
    return sa.Column(name, sa.String(length), primary_key=True)


def upgrade() -> None:
    op.create_table(
        "inference_agents",
        _key("app_id"), _key("agent_id"),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("prefix_candidate", sa.Text, nullable=True),
        sa.Column("prefix_hits", sa.Integer, nullable=False),
        sa.Column("fixed_prefix_chars", sa.Integer, nullable=False),
        sa.Column("waited_all", sa.Integer, nullable=False),
        sa.Column("waited_some", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "inference_edges",
        _key("app_id"), _key("target"), _key("source"), _key("kind", 16),
        sa.Column("count", sa.Integer, nullable=False),
    )
    op.create_table(
        "inference_sessions",
        _key("app_id"), _key("session_id"),
        sa.Column("num_requests", sa.Integer, nullable=False),
        sa.Column("question_seq", sa.Integer, nullable=True),
        sa.Column("last_agent", sa.String(128), nullable=True),
        sa.Column("series", sa.Text, nullable=False),
        sa.Column("last_round_size", sa.Integer, nullable=True),
        sa.Column("current_round", sa.String(160), nullable=True),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_inference_sessions_last_seen", "inference_sessions", ["last_seen"])
    op.create_table(
        "inference_segments",
        _key("app_id"), _key("session_id"), sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("agent_id", sa.String(128), nullable=True),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "inference_rounds",
        _key("app_id"), _key("session_id"), _key("round_id", 160),
        sa.Column("outputs", sa.Text, nullable=False),
        sa.Column("expected", sa.Integer, nullable=False),
        sa.Column("num_requests", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    for table in ("inference_rounds", "inference_segments", "inference_sessions", "inference_edges",
                  "inference_agents"):
        op.drop_table(table)
