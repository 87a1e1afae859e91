"""API keys in SQL, stored as sha256 hashes.

Why sha256 and not a password hash (bcrypt, argon2): a key is 256 random bits, not a
human secret, so a fast hash cannot be brute-forced and lets the gateway check a key on
every request in microseconds. The secret itself is shown once, when it is created.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from kvrelay.gateway.storage.models import ApiKeyRow

KEY_PREFIX = "kvr-"
_SHOWN_CHARS = 10  # "kvr-" and six characters: enough to tell keys apart in a listing


class KeyInfo(NamedTuple):
    id: str
    name: str
    prefix: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    created_at: datetime
    revoked_at: datetime | None


class CreatedKey(NamedTuple):
    info: KeyInfo
    secret: str  # the only time it is ever seen


class KeyNotFoundError(LookupError):
    """No key has this id."""


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _info(row: Any) -> KeyInfo:
    """A KeyInfo from an api_keys row (ORM object or result row)."""
    return KeyInfo(row.id, row.name, row.prefix, row.requests_per_minute, row.tokens_per_minute,
                   row.created_at, row.revoked_at)


class KeyStore:
    """Create, list, revoke and load keys. Every method is one short transaction."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def create(self, name: str, requests_per_minute: int | None = None,
                     tokens_per_minute: int | None = None) -> CreatedKey:
        if not name.strip() or len(name) > 128:
            raise ValueError("a key needs a name of 1 to 128 characters")
        for limit, label in ((requests_per_minute, "requests per minute"), (tokens_per_minute, "tokens per minute")):
            if limit is not None and limit < 1:
                raise ValueError(f"{label} must be at least 1 (leave it unset for no limit)")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        info = KeyInfo(f"key_{secrets.token_hex(8)}", name.strip(), secret[:_SHOWN_CHARS], requests_per_minute,
                       tokens_per_minute, datetime.now(UTC), None)
        async with self._engine.begin() as conn:
            await conn.execute(insert(ApiKeyRow).values(sha256=hash_key(secret), **info._asdict()))
        return CreatedKey(info, secret)

    async def list(self) -> list[KeyInfo]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(select(ApiKeyRow).order_by(ApiKeyRow.created_at))).all()
        return [_info(r) for r in rows]

    async def revoke(self, key_id: str) -> KeyInfo:
        """Revoke a key (idempotent); raises KeyNotFoundError for an unknown id."""
        async with self._engine.begin() as conn:
            await conn.execute(update(ApiKeyRow).where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
                               .values(revoked_at=datetime.now(UTC)))
            row = (await conn.execute(select(ApiKeyRow).where(ApiKeyRow.id == key_id))).first()
        if row is None:
            raise KeyNotFoundError(f"no API key with id {key_id!r}")
        return _info(row)

    async def active_by_hash(self) -> dict[str, KeyInfo]:
        """Every key not revoked, by the sha256 of its secret."""
        async with self._engine.connect() as conn:
            rows = (await conn.execute(select(ApiKeyRow).where(ApiKeyRow.revoked_at.is_(None)))).all()
        return {r.sha256: _info(r) for r in rows}
