"""inferred agents: the name the traffic gives them, and the reads that show rounds

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("inference_agents") as batch:
        batch.add_column(sa.Column("name", sa.String(128), nullable=True))
        batch.add_column(sa.Column("composed_reads", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("transcript_reads", sa.Integer, nullable=False, server_default="0"))
    # Rounds were keyed by the set of outputs their members read; they are passes now, and
    # the sets read do not say which pass they were: the old rows are dropped, sessions
    # find their next rounds afresh.
    op.execute("DELETE FROM inference_rounds")


def downgrade() -> None:
    with op.batch_alter_table("inference_agents") as batch:
        batch.drop_column("transcript_reads")
        batch.drop_column("composed_reads")
        batch.drop_column("name")
