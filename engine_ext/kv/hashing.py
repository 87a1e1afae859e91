"""Chained block hashes: a block's hash covers its tokens and every block before it.

The chain starts from a namespace (the model, an adapter, then the tenant), so
identical token blocks under different models, or of different tenants, never share
KV: a tenant can neither reuse nor time another's cache. blake2b keeps collisions out of reach,
which Python's 64-bit `hash` would not.
"""

from __future__ import annotations

import hashlib
from array import array


def namespace_root(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


DEFAULT_TENANT = "default"  # requests without a (trusted) plan, and every plan that names no tenant


def tenant_root(root: bytes, tenant: str) -> bytes:
    """The root of `tenant`'s own chains under `root`; the default tenant keeps `root`."""
    if tenant == DEFAULT_TENANT:
        return root
    return hashlib.blake2b(root + b"\x00tenant\x00" + tenant.encode(), digest_size=16).digest()


def chain_hash(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    payload = array("q", token_ids).tobytes()
    return hashlib.blake2b(parent + payload, digest_size=16).digest()


def block_hashes(root: bytes, token_ids: list[int], block_size: int, start: int = 0,
                 parent: bytes | None = None) -> list[bytes]:
    """Hashes of the full blocks of token_ids from block index `start` on."""
    out = []
    prev = root if parent is None else parent
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        prev = chain_hash(prev, token_ids[begin : begin + block_size])
        out.append(prev)
    return out
