"""api keys, and the key each request came with

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("requests_per_minute", sa.Integer, nullable=True),
        sa.Column("tokens_per_minute", sa.Integer, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    with op.batch_alter_table("requests") as batch:  # batch mode: SQLite cannot ALTER in place
        batch.add_column(sa.Column("api_key_id", sa.String(32), nullable=True))
        batch.create_index("ix_requests_api_key_id", ["api_key_id"])


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_index("ix_requests_api_key_id")
        batch.drop_column("api_key_id")
    op.drop_table("api_keys")
