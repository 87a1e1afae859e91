"""CacheLock and Pins: one way to hold, and to let go of, what a request pins in the caches.

A request reading KV that other requests keep (a cached segment, an anchor's offsets,
a stored round cache) pins the blocks behind it so they are not evicted under it. Each
cache had its own words for that (acquire/release on the segment index and the blobs,
acquire/release on the diff store); every place that let a request go (preemption,
finish, an admission undone, a failed prefill) had to know which of them the request
held. Here each pin is a `CacheLock` made when it is taken, and a request's locks sit
in one `Pins` holder that lets go of all of them in one idempotent call.

The block pool's own blocks (a sequence's KV) are not pins: they are the request's
memory, freed by the KV manager. Lower-tier slots are pinned only for the length of a
transfer, inside the tiered store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the caches' modules import this one's users
    from engine_ext.diffs.store import DiffStore
    from engine_ext.diffs.stored import StoredCache
    from engine_ext.kv.blobs import Blob, BlobStore
    from engine_ext.kv.segment_index import SegmentEntry, SegmentIndex


class CacheLock(ABC):
    """One pin, taken when the lock is made. Contract: `release` lets the pinned blocks go
    back to their cache's eviction order, and is idempotent: a second call does nothing,
    so every path that ends a request may call it without knowing whether another did."""

    def __init__(self) -> None:
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        if self._held:
            self._held = False
            self._unpin()

    @abstractmethod
    def _unpin(self) -> None:
        """Give the pin back to its cache; called once."""


class SegmentLock(CacheLock):
    """A segment index entry's blocks (a placed segment, or the base a KVCOMM anchor is measured on)."""

    def __init__(self, index: SegmentIndex, entry: SegmentEntry) -> None:
        super().__init__()
        self.index, self.entry = index, entry

    def _unpin(self) -> None:
        self.index.release(self.entry)


class BlobLock(CacheLock):
    """A blob's blocks (the offsets a KVCOMM prediction adds)."""

    def __init__(self, blobs: BlobStore, blob: Blob) -> None:
        super().__init__()
        self.blobs, self.blob = blobs, blob

    def _unpin(self) -> None:
        self.blobs.release(self.blob)


class StoredCacheLock(CacheLock):
    """What a stored round cache's view reads (its master's blocks and its diff's)."""

    def __init__(self, store: DiffStore, stored: StoredCache) -> None:
        super().__init__()
        self.store, self.stored = store, stored

    def _unpin(self) -> None:
        self.store.release(self.stored)


class Pins:
    """Every lock one request (or one placement plan) holds. `release` lets go of all of
    them, in the order they were added, and forgets them: idempotent, and the holder
    can take new pins afterwards (a preempted request admitted again)."""

    def __init__(self, locks: Iterable[CacheLock] = ()) -> None:
        self._locks: list[CacheLock] = list(locks)

    def add(self, *locks: CacheLock) -> None:
        self._locks.extend(locks)

    def __len__(self) -> int:
        return sum(1 for lock in self._locks if lock.held)

    def release(self) -> None:
        locks, self._locks = self._locks, []
        for lock in locks:
            lock.release()
