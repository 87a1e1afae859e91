"""cache_salt: which cached KV a request may share, the same field on every engine.

vLLM mixes a request's `cache_salt` into its prefix cache's block hashes, so requests
share cached KV only with requests of the same salt; a tenant that can be told apart by
a prefix hit's timing is isolated only if the salt comes from someone it cannot choose.
The gateway is that someone: it sets the salt of every request it forwards from the
request's tenant namespace (kvrelay/gateway/tenancy.py), keyed by the plan secret so
that no client can compute another tenant's salt, and mixes in the client's own salt
rather than passing it on (a client may split its own tenant further, never join
another). The embedded engine and the vLLM connector's tiers key what they keep by the
plan's tenant and the salt together, as vLLM's own cache does.
"""

from __future__ import annotations

import hashlib
import hmac

SALT_FIELD = "cache_salt"
MAX_SALT_CHARS = 128
_FORBIDDEN = frozenset("@/\\\0")  # vLLM refuses these (they would split its cache keys)
_PUBLIC_KEY = b"kvrelay cache salt without a plan secret"
# The field in the OpenAPI schemas of the gateway and the engine.
SALT_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_SALT_CHARS, "pattern": "^[^@/\\\\\\u0000]+$"}


def check_salt(value: object) -> str | None:
    """The salt a request carries, as vLLM accepts it: None, or a non-empty string of at
    most 128 characters without '@', '/', '\\' or NUL. Raises ValueError otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("cache_salt must be a non-empty string")
    if len(value) > MAX_SALT_CHARS or any(char in _FORBIDDEN for char in value):
        raise ValueError(f"cache_salt must have at most {MAX_SALT_CHARS} characters and no '@', '/', '\\' or NUL")
    return value


def salted_tenant(tenant: str, salt: str | None) -> str:
    """The key an engine's caches keep a request's KV under: its tenant, split by salt."""
    if salt is None:
        return tenant
    return f"{tenant}|salt:{hashlib.sha256(salt.encode()).hexdigest()[:32]}"


class TenantSalts:
    """The salt the gateway sends for a tenant namespace (and the client's own salt).

    With a plan secret the salt is an HMAC under it: unguessable, and the same on every
    gateway replica and across restarts, so engines keep their hits. Without one it is a
    public function of the namespace: still apart per tenant through the gateway, but a
    process that reaches the engine directly could compute it (as it could send an
    unsealed plan; `kvrelay up` always sets a secret)."""

    def __init__(self, secret: str | None, max_cached: int = 4096) -> None:
        self._key = b"cache_salt\0" + secret.encode() if secret is not None else _PUBLIC_KEY
        self._cached: dict[tuple[str, str | None], str] = {}  # every request asks; few distinct answers
        self._max_cached = max_cached

    def salt(self, namespace: str, client_salt: str | None = None) -> str:
        key = (namespace, client_salt)
        salt = self._cached.get(key)
        if salt is None:
            message = namespace.encode() + b"\0" + (client_salt or "").encode()
            salt = hmac.digest(self._key, message, "sha256").hex()  # 64 hex characters
            if len(self._cached) >= self._max_cached:
                self._cached.clear()  # client salts are unbounded; the tenants' own come back at once
            self._cached[key] = salt
        return salt
