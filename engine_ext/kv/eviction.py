"""Eviction policies: which cached blocks leave a tier first.

A policy orders candidates; the first go first. Candidates come in the tier's LRU order
(least recently used first), and that position is every policy's tiebreak, so plain
LRU is the policy that keeps the order as it is. The KV pool and each lower tier
(engine_ext/tiers) ask the same policy, so one view decides every eviction.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TypeVar

Item = TypeVar("Item")


class EvictionPolicy(ABC):
    """Contract: `victims` returns `num` items of `candidates` (fewer if there are fewer),
    best victims first; candidates are (item, block hash or None for an empty block)
    in least-recently-used order."""

    @abstractmethod
    def victims(self, candidates: Iterable[tuple[Item, bytes | None]], num: int) -> list[Item]: ...

    def spares(self, block_hash: bytes | None, steps: float) -> bool:
        """Whether evicting this block costs nothing an agent `steps` away needs sooner
        (prefetching for that agent may take it). LRU knows no future: only empty blocks."""
        return block_hash is None


class LruPolicy(EvictionPolicy):
    def victims(self, candidates: Iterable[tuple[Item, bytes | None]], num: int) -> list[Item]:
        return [item for item, _ in itertools.islice(candidates, num)]
