"""KeyStore: keys stored as hashes, shown once, revocable."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from kvrelay.gateway.auth import KeyNotFoundError, KeyStore
from kvrelay.gateway.auth.keys import hash_key
from kvrelay.gateway.storage import migrate


@pytest.fixture
async def store(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'keys.sqlite'}"
    await asyncio.to_thread(migrate.upgrade, url)  # alembic runs its own event loop
    engine = create_async_engine(url)
    yield KeyStore(engine)
    await engine.dispose()


async def test_create_returns_the_secret_once_and_stores_only_its_hash(store):
    created = await store.create("alice", requests_per_minute=10)
    assert created.secret.startswith("kvr-") and len(created.secret) > 40
    assert created.info.prefix == created.secret[:10] and created.info.requests_per_minute == 10
    async with store._engine.connect() as conn:
        rows = (await conn.execute(text("SELECT * FROM api_keys"))).mappings().all()
    assert len(rows) == 1
    assert created.secret not in " ".join(str(v) for v in rows[0].values())
    assert rows[0]["sha256"] == hash_key(created.secret)


async def test_active_keys_are_found_by_hash_until_revoked(store):
    a, b = await store.create("a"), await store.create("b")
    active = await store.active_by_hash()
    assert {k.id for k in active.values()} == {a.info.id, b.info.id}
    revoked = await store.revoke(a.info.id)
    assert revoked.revoked_at is not None
    assert hash_key(a.secret) not in await store.active_by_hash()
    again = await store.revoke(a.info.id)  # idempotent: keeps the first revocation time
    assert again.revoked_at == revoked.revoked_at
    assert [k.revoked_at is None for k in await store.list()] == [False, True]


async def test_unknown_key_and_bad_limits_are_refused(store):
    with pytest.raises(KeyNotFoundError, match="no API key"):
        await store.revoke("key_missing")
    for kwargs in ({"name": " "}, {"name": "x" * 129}, {"name": "n", "requests_per_minute": 0},
                   {"name": "n", "tokens_per_minute": -5}):
        with pytest.raises(ValueError):
            await store.create(**kwargs)
