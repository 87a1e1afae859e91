"""Alembic environment: the URL comes from the gateway settings (KVRELAY_DATABASE_URL),
or from `-x url=...` / the Config's `sqlalchemy.url` when a caller sets one."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from kvrelay.gateway.settings import GatewaySettings
from kvrelay.gateway.storage.models import Base

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    return (
        context.get_x_argument(as_dictionary=True).get("url")
        or config.get_main_option("sqlalchemy.url")
        or GatewaySettings().database_url
    )


def run_offline() -> None:
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


async def run_online() -> None:
    engine = create_async_engine(database_url())
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run_sync)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    asyncio.run(run_online())
