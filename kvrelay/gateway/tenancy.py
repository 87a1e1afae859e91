"""Tenants and the engine cache namespace each one's plans name.

A tenant is the API key's app (its key id) or, with client keys off, the app the
client names (X-Kvrelay-App): every engine cache is namespaced by it, so one tenant
neither reuses nor times another's cached text. Reuse across tenants happens only
when configured, per pair: `inference.shared_caches: [["team-a", "team-b"]]` gives both
one namespace. A tenant may be in one pair (group) only: overlapping groups would
share transitively (a-b and b-c letting a read c), so they are refused at startup.

Namespaces are `app:<tenant>` or `group:<hash of the members>`: never the engine's
default tenant (plan-less requests), never each other, and short whatever the names.
"""

from __future__ import annotations

import hashlib


class TenantMap:
    def __init__(self, shared: list[list[str]] | None = None) -> None:
        self._namespace: dict[str, str] = {}
        for group in shared or []:
            members = sorted(set(group))
            if len(members) < 2:
                raise ValueError(f"inference.shared_caches: {group!r} names fewer than two tenants")
            namespace = "group:" + hashlib.sha256("\x00".join(members).encode()).hexdigest()[:32]
            for tenant in members:
                if tenant in self._namespace:
                    raise ValueError(f"inference.shared_caches: tenant {tenant!r} is in two groups; "
                                     "groups must not overlap (sharing would be transitive)")
                self._namespace[tenant] = namespace

    def namespace(self, tenant: str) -> str:
        """The cache namespace of a tenant's requests: its own, or its group's."""
        return self._namespace.get(tenant) or f"app:{tenant}"
