"""inferred state shared by gateway replicas: the log of what each one observed

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "inference_observations",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("replica", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("observed_at", sa.Float, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_inference_observations_created_at", "inference_observations", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_inference_observations_created_at", "inference_observations")
    op.drop_table("inference_observations")
