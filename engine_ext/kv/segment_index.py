"""SegmentIndex: the KV of token segments, reusable at any position of any prompt.

The prefix cache can only serve a prompt's first tokens. A segment (a document, another
agent's answer) recurs at different positions behind different prefixes, so its KV is
kept apart, keyed by the segment's tokens alone, in one canonical frame: keys rotated
as if the segment started at position 0. Using it elsewhere is one RoPE shift away.

Segment KV lives in blobs (kv/blobs.py): blocks of the prefix cache's pool, so it shares
the one memory budget and the one LRU eviction. A blob's key is the hash of the
segment's tokens under a segment root (never equal to a prefix hash); one evicted block
invalidates the entry and later lookups miss.

A text quoted inline ("klaus: The weather...") is tokenized differently at its first
word (" The", not "The"), so the prompt's segment holds the answer's tokens from the
second or third on (engine_ext/reuse/aligner.py trims it to whole tokens). Each entry
is therefore also findable by its tails, its tokens less the first MAX_TAIL_DROP or
fewer: a lookup of a tail copies those rows into an entry of their own (keys moved
back to position 0), once, and every later reader finds that one.

Every registration is a new version of its content: the same tokens evicted and
registered again get the same key (and the same block hashes) but KV computed anew,
perhaps behind another prefix, so anything measured against the old KV (KVCOMM's
offsets) must tell the two apart. `SegmentEntry.identity` is (content key, version).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from engine_ext.kv.blobs import Blob, BlobStore
from engine_ext.kv.block_pool import BlockPool
from engine_ext.kv.cache import KVCache
from engine_ext.kv.hashing import DEFAULT_TENANT, chain_hash, namespace_root, tenant_root
from engine_ext.rope import RopeShifter

MAX_TAIL_DROP = 3  # leading tokens a tail lookup may drop: a first word's worth


class EntryIdentity(NamedTuple):
    """Which KV an entry holds: its content and the registration that wrote it. Two
    entries with equal identities hold the very same KV; the same tokens registered
    again (after an eviction) keep the key but get a new version."""

    key: bytes  # SegmentEntry.key: derived from the tenant and the tokens alone
    version: int  # the registration, unique within the index and increasing


class SegmentEntry(NamedTuple):
    token_ids: tuple[int, ...]
    blob: Blob  # the segment's KV, keys in the canonical frame
    version: int  # which registration wrote the KV (SegmentIndex numbers them from 1 on)
    # True: the KV of an answer as its writer generated it (in an assistant turn), which no
    # reader's prompt holds; False: a text as some prompt computed it (KVCOMM, bank.py).
    generated: bool = False

    @property
    def key(self) -> bytes:
        """The segment's identity across prompts (the same tokens give the same key)."""
        return self.blob.block_hashes[0]

    @property
    def identity(self) -> EntryIdentity:
        """Content and version: what a measurement against this KV must record to be
        applied to this KV alone (the key alone survives a re-registration)."""
        return EntryIdentity(self.key, self.version)


class SegmentIndex:
    def __init__(self, pool: BlockPool, kv_cache: KVCache, shifter: RopeShifter, namespace: str) -> None:
        self.pool = pool
        self.kv_cache = kv_cache
        self.shifter = shifter
        self.blobs = BlobStore(pool, kv_cache)
        self.root = namespace_root(f"{namespace}\x00segment")
        self._entries: dict[bytes, SegmentEntry] = {}
        self._versions = itertools.count(1)  # one per registration, never reused
        self._held: set[int] = set()  # versions of the entries in _entries
        self._tails: dict[bytes, tuple[bytes, int]] = {}  # tail key -> (entry key, tokens dropped)
        self.num_hits = 0
        self.num_misses = 0
        self.num_registered = 0
        self.num_skipped = 0  # registrations refused for lack of free blocks

    # -- lookup ------------------------------------------------------------------------
    def _key(self, token_ids: tuple[int, ...], tenant: str) -> bytes:
        return chain_hash(tenant_root(self.root, tenant), token_ids)

    def lookup(self, token_ids: list[int] | tuple[int, ...], tenant: str = DEFAULT_TENANT) -> SegmentEntry | None:
        """The entry holding exactly these tokens for `tenant`, or None (never cached by
        that tenant, or evicted), or a new entry made from the tail of one it holds."""
        tokens = tuple(token_ids)
        entry = self._find(tokens, tenant) or self._from_tail(tokens, tenant)
        if entry is None:
            self.num_misses += 1
        else:
            self.num_hits += 1
        return entry

    def _find(self, tokens: tuple[int, ...], tenant: str) -> SegmentEntry | None:
        if not tokens:
            return None
        key = self._key(tokens, tenant)
        entry = self._entries.get(key)
        if entry is not None and not self.blobs.valid(entry.blob):
            self._drop(key, entry)
            return None
        return entry if entry is not None and entry.token_ids == tokens else None  # tokens guard collisions

    def _from_tail(self, tokens: tuple[int, ...], tenant: str) -> SegmentEntry | None:
        """Register `tokens` from the entry they are a tail of, if one is held."""
        ref = self._tails.get(self._key(tokens, tenant)) if tokens else None
        if ref is None:
            return None
        key, dropped = ref
        full = self._entries.get(key)
        if full is None or full.token_ids[dropped:] != tokens or self._find(full.token_ids, tenant) is None:
            return None
        self.blobs.acquire(full.blob)  # allocating the copy must not evict what it copies
        try:
            self.register(list(tokens), self.slots(full)[dropped:], dropped, tenant, full.generated)
        finally:
            self.blobs.release(full.blob)
        return self._find(tokens, tenant)

    def peek(self, token_ids: list[int] | tuple[int, ...], tenant: str = DEFAULT_TENANT) -> SegmentEntry | None:
        """Like `lookup`, without counting a hit or miss: for checking which version the
        index holds (KVCOMM's offsets), not for reusing it."""
        return self._find(tuple(token_ids), tenant)

    def is_current(self, entry: SegmentEntry) -> bool:
        """Whether the index still holds this very registration, blocks intact. A stale
        entry's blob can look valid when a re-registration of the same tokens got its
        old blocks (same hashes), so validity alone does not say it."""
        return entry.version in self._held and self.blobs.valid(entry.blob)

    def acquire(self, entry: SegmentEntry) -> None:
        """Pin an entry's blocks (they leave the LRU) until `release`."""
        self.blobs.acquire(entry.blob)

    def release(self, entry: SegmentEntry) -> None:
        self.blobs.release(entry.blob)

    def slots(self, entry: SegmentEntry) -> torch.Tensor:
        """Cache slots of the entry's tokens in order, (n,)."""
        return self.blobs.slots(entry.blob)

    # -- registration ------------------------------------------------------------------
    def register(self, token_ids: list[int], src_slots: torch.Tensor, src_position: int,
                 tenant: str = DEFAULT_TENANT, generated: bool = False) -> bool:
        """Copy the KV at `src_slots` (tokens computed from position `src_position` on)
        into new blocks, keys shifted back to position 0, for `tenant` alone. The first
        registration of a token sequence wins; False when it is already held or no block
        is free. Each registration gets a new version (see EntryIdentity). `generated`:
        the KV is an answer as its writer decoded it, not a prompt's."""
        tokens = tuple(token_ids)
        if not tokens or self._find(tokens, tenant) is not None:
            return False
        key = self._key(tokens, tenant)
        blob = self.blobs.allocate(key, len(tokens))
        if blob is None:
            self.num_skipped += 1
            return False
        self.copy_shifted(src_slots, self.blobs.slots(blob), -src_position)
        self.blobs.seal(blob)
        entry = SegmentEntry(tokens, blob, next(self._versions), generated)
        replaced = self._entries.get(key)  # only ever a hash collision: the valid ones were found above
        if replaced is not None:
            self._held.discard(replaced.version)
        self._entries[key] = entry
        self._held.add(entry.version)
        for dropped in range(1, min(MAX_TAIL_DROP, len(tokens) - 1) + 1):
            self._tails[self._key(tokens[dropped:], tenant)] = (key, dropped)
        self.num_registered += 1
        self._prune()
        return True

    def copy_shifted(self, src: torch.Tensor, dst: torch.Tensor, delta: int | torch.Tensor) -> None:
        """Copy K and V of every layer from slots `src` to slots `dst` (both (n,)), keys
        moved `delta` positions (one for all, or (n,) per key): into the canonical frame
        at registration, out of it at use."""
        for k_cache, v_cache in self.kv_cache.layers:
            keys = self.shifter.shift(k_cache.index_select(0, src), delta)  # (n, kv_heads, D)
            k_cache.index_copy_(0, dst, keys)
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    def _drop(self, key: bytes, entry: SegmentEntry) -> None:
        """Forget an entry whose blocks were (partly) evicted; its survivors are stale."""
        del self._entries[key]
        self._held.discard(entry.version)
        self.blobs.discard(entry.blob)

    def _prune(self) -> None:
        """Drop dead entries once they could outnumber the blocks (each live one holds one)."""
        if len(self._entries) > self.pool.num_blocks:
            for key, entry in list(self._entries.items()):
                if not self.blobs.valid(entry.blob):
                    self._drop(key, entry)
        if len(self._tails) > MAX_TAIL_DROP * self.pool.num_blocks:
            self._tails = {tail: ref for tail, ref in self._tails.items() if ref[0] in self._entries}

    # -- accounting --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(len(e.blob.blocks) for e in self._entries.values() if self.blobs.valid(e.blob))

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.kv_cache.bytes_per_block
