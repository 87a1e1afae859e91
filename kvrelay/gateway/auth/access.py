"""Who may call, and how often: API key checks and rate limits on the request path.

Active keys live in memory, keyed by hash, so a check costs one sha256 and a dict
lookup. They are reloaded from SQL every `key_refresh_s` (a key revoked with the CLI,
in another process, stops working within that time) and at once after an admin route
changes them. If the database is down, the last loaded keys stay in force.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

from sqlalchemy.exc import SQLAlchemyError

from kvrelay.gateway.auth.estimate import TokenEstimator
from kvrelay.gateway.auth.keys import KeyInfo, KeyStore, hash_key
from kvrelay.gateway.auth.ratelimit import RateLimiter, retry_after_header
from kvrelay.gateway.errors import AuthenticationError, RateLimitedError

logger = logging.getLogger(__name__)


class Charge(NamedTuple):
    """What a call was charged against its key's token bucket, to settle afterwards."""

    key: KeyInfo
    estimated_tokens: int


class AccessControl:
    def __init__(self, store: KeyStore, required: bool, limiter: RateLimiter, refresh_s: float,
                 estimator: TokenEstimator | None) -> None:
        self.store = store
        self.required = required
        self.limiter = limiter
        self._refresh_s = refresh_s
        self._estimator = estimator
        self._keys: dict[str, KeyInfo] = {}

    async def refresh(self) -> None:
        self._keys = await self.store.active_by_hash()

    async def refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except (SQLAlchemyError, OSError) as exc:
                logger.warning("reloading API keys failed (%s); the last loaded keys stay in force", type(exc).__name__)

    def authenticate(self, headers: Mapping[str, str]) -> KeyInfo | None:
        """The caller's key, None when keys are not required; raises AuthenticationError."""
        if not self.required:
            return None
        scheme, _, secret = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise AuthenticationError("an API key is required: send the header `Authorization: Bearer <key>`")
        key = self._keys.get(hash_key(secret.strip()))
        if key is None:
            raise AuthenticationError("the API key is invalid or has been revoked")
        return key

    def admit(self, key: KeyInfo | None, body: Mapping[str, Any]) -> Charge | None:
        """Take the call from the key's rate limits; raises RateLimitedError when over them."""
        if key is None:
            return None
        estimate = 0
        if self._estimator is not None and self.limiter.needs_estimate(key):
            estimate = self._estimator.prompt_tokens(body)
        admission = self.limiter.admit(key, estimate)
        if admission.too_large:
            raise RateLimitedError(f"the prompt (about {estimate} tokens) exceeds this key's limit of "
                                   f"{self.limiter.limits(key)[1]} tokens per minute")
        if not admission.admitted:
            raise RateLimitedError(
                f"rate limit reached for {admission.reason} per minute; retry in {admission.retry_after_s:.1f}s",
                headers={"Retry-After": retry_after_header(admission.retry_after_s)})
        return Charge(key, estimate)

    def settle(self, charge: Charge | None, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        if charge is not None and prompt_tokens is not None:
            self.limiter.settle(charge.key, charge.estimated_tokens, prompt_tokens + (completion_tokens or 0))
