"""Chained block hashes: a block's hash covers its tokens and every block before it.

The chain starts from a namespace (the model, later the adapter), so identical token
blocks under different models never share KV. blake2b keeps collisions out of reach,
which Python's 64-bit `hash` would not.
"""

from __future__ import annotations

import hashlib
from array import array


def namespace_root(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


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
