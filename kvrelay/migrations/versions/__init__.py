"""Alembic revisions of the gateway's schema, oldest first."""
