"""sessions, agents and requests

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "agents",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.id"), nullable=True),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_agents_session_id", "agents", ["session_id"])
    op.create_table(
        "requests",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.id"), nullable=True),
        sa.Column("agent_id", sa.String(128), sa.ForeignKey("agents.id"), nullable=True),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("upstream", sa.String(512), nullable=True),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=False),
        sa.Column("error_type", sa.String(64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("first_token_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("prompt_sha256", sa.String(64), nullable=False),
        sa.Column("prompt_chars", sa.Integer(), nullable=False),
        sa.Column("completion_sha256", sa.String(64), nullable=True),
        sa.Column("completion_chars", sa.Integer(), nullable=True),
        sa.Column("prompt_text", sa.Text(), nullable=True),
        sa.Column("completion_text", sa.Text(), nullable=True),
    )
    op.create_index("ix_requests_session_id", "requests", ["session_id"])
    op.create_index("ix_requests_agent_id", "requests", ["agent_id"])
    op.create_index("ix_requests_status", "requests", ["status"])
    op.create_index("ix_requests_started_at", "requests", ["started_at"])


def downgrade() -> None:
    op.drop_table("requests")
    op.drop_table("agents")
    op.drop_table("sessions")
