"""Paged KV memory: block pool, chained prefix hashes, per-sequence block tables, tensors."""

from __future__ import annotations

from engine_ext.kv.block_pool import Block, BlockPool
from engine_ext.kv.cache import KVCache
from engine_ext.kv.manager import KVCacheManager, PrefixMatch

__all__ = ["Block", "BlockPool", "KVCache", "KVCacheManager", "PrefixMatch"]
