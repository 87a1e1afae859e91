"""DiffStore: TokenDance's Master-Mirror storage of sibling KV caches.

After an All-Gather round, the members' caches are nearly the same: every member reused
the same shared segments, and only what each recomputed (its chosen positions, the
text between segments, its own question) differs. Kept densely, the round costs one
cache per member. Here one member is the master, kept densely; each sibling is a mirror
holding only the blocks where it differs from the master (kinds in diffs/stored.py).

A sibling token is compared with the master's token holding the same segment at the
same offset, else with the master's token at the same position (a later turn that
extends a stored prompt lines up with it this way).

The round's reuse plan names the master (the member with the lowest deviation); a
cache stored outside a round gets the stored master sharing most of its segment tokens
at the same offsets (token similarity), or becomes a master itself. Diffs are lossless
by default: a block is left out of a mirror only when every value of every layer,
K and V, moved from the master equals the sibling's own bit for bit (`tolerance` > 0
trades exactness for size). Everything lives in pool blocks (BlobStore), so stored
rounds share the engine's one KV budget and LRU; a view whose blocks were evicted is
dropped on read.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import NamedTuple

import torch

from engine_ext.diffs.images import CacheImage
from engine_ext.diffs.stored import (
    CacheView,
    MasterView,
    MirrorRows,
    MirrorView,
    StoredCache,
    StoredMaster,
    StoredMirror,
)
from engine_ext.kv.blobs import Blob, BlobStore
from engine_ext.kv.cache import KVCache
from engine_ext.kv.hashing import DEFAULT_TENANT, chain_hash, namespace_root, tenant_root
from engine_ext.kernels.rope_shift import shift_keys_torch

MIN_SHARED_FRACTION = 0.5  # a cache stored outside a round mirrors a master sharing at least this much


class StoreResult(NamedTuple):
    """What storing one round took, per image in the order given."""

    dense_bytes: list[int]  # what keeping each cache densely would take
    master: int  # index of the master image
    master_bytes: int  # 0 when the master could not be stored (no free blocks)
    mirror_bytes: list[int | None]  # diff blocks plus metadata; None for the master and any cache not stored
    seconds: float  # wall time of storing the round

    @property
    def num_stored_bytes(self) -> int:
        return self.master_bytes + sum(b for b in self.mirror_bytes if b is not None)


class DiffStore:
    def __init__(self, blobs: BlobStore, kv_cache: KVCache, inv_freq: torch.Tensor, namespace: str,
                 block_tokens: int = 32, tolerance: float = 0.0) -> None:
        self.blobs = blobs
        self.kv_cache = kv_cache
        self.inv_freq = inv_freq
        self.root = namespace_root(f"{namespace}\x00diff")
        self.block_tokens = block_tokens
        self.tolerance = tolerance
        self._stored: dict[bytes, StoredCache] = {}
        self._lengths: dict[int, Counter[int]] = {}  # region start -> prompt lengths stored (for match)
        self.last_round: StoreResult | None = None  # what the latest store_round kept
        # Over every round stored (engine /metrics): the mirrors' bytes against what their
        # caches would take kept densely (TokenDance's storage saving).
        self.num_rounds = 0
        self.mirrored_dense_bytes = 0
        self.mirror_bytes = 0
        self.mirrored_rows = 0  # the region rows of those caches
        self.mirror_rows = MirrorRows()  # the rows their diffs hold, by why

    # -- storing -----------------------------------------------------------------------
    def store_round(self, images: list[CacheImage], master: int) -> StoreResult:
        """Keep a round's caches: images[master] densely, the others as its mirrors."""
        start = time.perf_counter()
        head = self._store_master(images[master])
        mirror_bytes: list[int | None] = []
        for i, image in enumerate(images):
            mirror = self._store_mirror(image, head) if head is not None and i != master else None
            mirror_bytes.append(None if mirror is None else self.num_bytes(mirror))
            if mirror is not None:
                self.mirrored_rows += image.num_region_tokens
                self.mirror_rows = self.mirror_rows.plus(mirror.rows)
        self.last_round = StoreResult([self.dense_bytes(img) for img in images], master,
                                      self.num_bytes(head) if head else 0, mirror_bytes, time.perf_counter() - start)
        self.num_rounds += 1
        for dense, mirror_size in zip(self.last_round.dense_bytes, mirror_bytes):
            if mirror_size is not None:
                self.mirrored_dense_bytes += dense
                self.mirror_bytes += mirror_size
        return self.last_round

    def store(self, image: CacheImage, like: StoredCache | None = None) -> StoredCache | None:
        """Keep one cache outside a round: a mirror of `like`'s master (the cache it was
        restored from) when that is still held, else of the most similar master (the
        most region rows it shares as the same segment at the same offset, or the same
        token at the same position), else a master."""
        known = self._valid(like.master if isinstance(like, StoredMirror) else like) if like is not None else None
        if isinstance(known, StoredMaster):
            return self._store_mirror(image, known, like if isinstance(like, StoredMirror) else None)
        best, best_shared = None, 0
        for stored in self._masters(image.tenant):
            shared = int((self._align(image, stored) >= 0).sum())
            if shared > best_shared:
                best, best_shared = stored, shared
        if best is not None and best_shared >= MIN_SHARED_FRACTION * image.num_region_tokens:
            return self._store_mirror(image, best)
        return self._store_master(image)

    def _key(self, token_ids: tuple[int, ...] | list[int], tenant: str = DEFAULT_TENANT) -> bytes:
        return chain_hash(tenant_root(self.root, tenant), token_ids)

    def _store_master(self, image: CacheImage) -> StoredMaster | None:
        key = self._key(image.token_ids, image.tenant)
        held = self._valid(self._stored.get(key))
        if isinstance(held, StoredMaster):
            return held
        if held is not None:
            self._forget(held)  # kept as a mirror before: the round now wants it dense
        n = image.num_region_tokens
        blob = self.blobs.allocate(key, n)
        if blob is None:
            return None
        src = image.slots[image.region_start :].clone()  # (n,) verbatim by default
        ref = torch.arange(image.region_start, len(image.token_ids))  # (n,)
        index: dict[tuple[bytes, int], int] = {}
        for row, seg_key, offset, slot in image.canonical_rows():
            src[row], ref[row] = slot, offset  # the segment's own value, rotated for its offset
            index.setdefault((seg_key, offset), row)
        self._write(blob, src)
        tokens = torch.tensor(image.token_ids[image.region_start :], dtype=torch.long)
        stored = StoredMaster(key, len(image.token_ids), image.region_start, blob, ref, tokens, index,
                              tenant=image.tenant)
        self._add(stored)
        return stored

    def _store_mirror(self, image: CacheImage, master: StoredMaster,
                      restored: StoredMirror | None = None) -> StoredMirror | None:
        if master.tenant != image.tenant:
            return None  # a mirror reads its master: never another tenant's
        key = self._key(image.token_ids, image.tenant)
        if self._valid(self._stored.get(key)) is not None:
            return None  # already held (as a master or a mirror)
        n, start = image.num_region_tokens, image.region_start
        base = self._align(image, master, restored)  # (n,) master row per region row, or -1
        unshared = base < 0  # (n,) rows no master row may equal
        aligned = (~unshared).nonzero().flatten()  # (A,) rows with a master counterpart
        delta = torch.zeros(n, dtype=torch.long)
        delta[aligned] = start + aligned - master.ref[base[aligned]]
        base[aligned[~self._equal(master, base[aligned], delta[aligned], image.slots[start + aligned])]] = -1
        layout = self._layout(image)  # (m,) region row per layout position, -1: padding
        real = layout >= 0
        missing = torch.zeros(layout.shape[0], dtype=torch.bool)
        missing[real] = base[layout[real]] < 0
        touched = missing.view(-1, self.block_tokens).any(dim=1)  # (num_blocks,)
        kept = (touched.repeat_interleave(self.block_tokens) & real)  # (m,) layout positions stored verbatim
        per_block = kept.view(-1, self.block_tokens).sum(dim=1)  # (num_blocks,)
        block_diff = torch.where(touched, per_block.cumsum(0) - per_block, -1)  # offset of each touched block's rows
        stored = layout[kept]  # (S,) region rows stored verbatim
        num_unshared, num_missing = int(unshared[stored].sum()), int((base[stored] < 0).sum())
        rows = MirrorRows(num_unshared, num_missing - num_unshared, stored.shape[0] - num_missing)
        diff = None
        if kept.any():
            diff = self.blobs.allocate(chain_hash(key, (1,)), int(kept.sum()))
            if diff is None:
                return None
            self._write(diff, image.slots[start + layout[kept]])
        pad = torch.where(real, layout, 0)
        mirror = StoredMirror(key, len(image.token_ids), start, master, layout,
                              torch.where(real, base[pad], -1), torch.where(real, delta[pad], 0), block_diff, diff,
                              self.block_tokens, rows)
        master.mirrors.append(key)
        self._add(mirror)
        return mirror

    @staticmethod
    def _align(image: CacheImage, master: StoredMaster, restored: StoredMirror | None = None) -> torch.Tensor:
        """(n,) the master row each region row may equal, or -1: the row holding the same
        segment at the same offset, else the row holding the same token at the same
        position, else (an image that starts with the `restored` mirror's prompt) the row
        that mirror's row equals. Candidates only: the comparison of values decides."""
        n, start = image.num_region_tokens, image.region_start
        base = torch.full((n,), -1, dtype=torch.long)
        for row, seg_key, offset, _ in image.canonical_rows():
            base[row] = master.index.get((seg_key, offset), -1)
        if master.region_start == start:
            rows = torch.arange(min(n, master.tokens.shape[0]))
            tokens = torch.tensor(image.token_ids[start : start + rows.shape[0]], dtype=torch.long)
            same = (base[rows] < 0) & (master.tokens[rows] == tokens)
            base[rows[same]] = rows[same]
        if restored is not None and restored.region_start == start:
            bases = restored.row_bases()[:n]
            rows = (base[: bases.shape[0]] < 0).nonzero().flatten()
            base[rows] = bases[rows]
        return base

    def _write(self, blob: Blob, src: torch.Tensor) -> None:
        """Copy the KV at slots src (n,) into a freshly allocated blob, every layer, and seal it."""
        dst = self.blobs.slots(blob)
        try:
            for k_cache, v_cache in self.kv_cache.layers:
                k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
                v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
        except BaseException:
            self.blobs.abandon(blob)
            raise
        self.blobs.seal(blob)

    def _layout(self, image: CacheImage) -> torch.Tensor:
        """Region rows in blocks that follow the prompt's structure: each span (a
        segment, or the text between segments) starts a new block and its last block is
        padded (-1). The text between segments differs in every sibling; aligned this
        way it touches its own small blocks, not the segments' blocks around it."""
        size, bounds = self.block_tokens, image.cuts()
        parts = []
        for lo, hi in zip(bounds, bounds[1:]):
            for block_lo in range(lo, hi, size):
                block = torch.arange(block_lo, min(block_lo + size, hi))
                parts.append(torch.cat((block, torch.full((size - block.shape[0],), -1, dtype=torch.long))))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def _equal(self, master: StoredMaster, rows: torch.Tensor, delta: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
        """(A,) bool: whether each master row, moved by delta, equals the KV at slots in every layer."""
        src = self.blobs.slots(master.blob)[rows]  # (A,)
        same = torch.ones(rows.shape[0], dtype=torch.bool)
        for k_cache, v_cache in self.kv_cache.layers:
            keys = shift_keys_torch(k_cache.index_select(0, src), delta, self.inv_freq)  # (A, kv_heads, D)
            for moved, own in ((keys, k_cache.index_select(0, slots)), (v_cache.index_select(0, src),
                                                                         v_cache.index_select(0, slots))):
                if self.tolerance > 0:
                    same &= (moved.float() - own.float()).abs().flatten(1).amax(dim=1) <= self.tolerance
                else:
                    same &= torch.eq(moved, own).flatten(1).all(dim=1)
        return same

    # -- reading -----------------------------------------------------------------------
    def read(self, token_ids: list[int] | tuple[int, ...], tenant: str = DEFAULT_TENANT) -> CacheView | None:
        """A lazy view of the cache `tenant` stored for exactly this prompt, or None."""
        stored = self._valid(self._stored.get(self._key(tuple(token_ids), tenant)))
        return None if stored is None else self._view(stored)

    def match(self, token_ids: list[int], num_prefix_tokens: int,
              tenant: str = DEFAULT_TENANT) -> tuple[StoredCache, CacheView] | None:
        """The longest prompt `tenant` stored that starts `token_ids` (short of its last
        token) and whose region starts where the prefix cache's hit ends."""
        for length in sorted(self._lengths.get(num_prefix_tokens, ()), reverse=True):
            if length < len(token_ids):
                stored = self._valid(self._stored.get(self._key(token_ids[:length], tenant)))
                if stored is not None and stored.region_start == num_prefix_tokens:
                    return stored, self._view(stored)
        return None

    def _view(self, stored: StoredCache) -> CacheView:
        if isinstance(stored, StoredMaster):
            positions = torch.arange(stored.region_start, stored.num_tokens)
            return MasterView(stored.num_tokens, stored.region_start, self.blobs.slots(stored.blob),
                              positions - stored.ref, self.inv_freq)
        master_slots = self.blobs.slots(stored.master.blob)
        base_src = torch.where(stored.base >= 0, master_slots[stored.base.clamp(min=0)], -1)  # (m,)
        diff_slots = self.blobs.slots(stored.diff) if stored.diff else torch.empty(0, dtype=torch.long)
        return MirrorView(stored.num_tokens, stored.region_start, stored.layout, base_src, stored.delta,
                          stored.block_diff, diff_slots, stored.block_tokens, self.inv_freq)

    def acquire(self, stored: StoredCache) -> None:
        """Pin what a view reads (the master's blocks and the diff's) until `release`."""
        for blob in self._blobs_of(stored):
            self.blobs.acquire(blob)

    def release(self, stored: StoredCache) -> None:
        for blob in self._blobs_of(stored):
            self.blobs.release(blob)

    @staticmethod
    def _blobs_of(stored: StoredCache) -> list[Blob]:
        if isinstance(stored, StoredMaster):
            return [stored.blob]
        return [stored.master.blob] + ([stored.diff] if stored.diff else [])

    def _valid(self, stored: StoredCache | None) -> StoredCache | None:
        """The entry if every block it reads is still in the pool; else forget it."""
        if stored is None:
            return None
        if all(self.blobs.valid(b) for b in self._blobs_of(stored)):
            return stored
        self._forget(stored)
        return None

    def _add(self, stored: StoredCache) -> None:
        self._stored[stored.key] = stored
        self._lengths.setdefault(stored.region_start, Counter())[stored.num_tokens] += 1
        if len(self._stored) > self.blobs.pool.num_blocks:  # dead entries could pile up: sweep them
            for entry in list(self._stored.values()):
                self._valid(entry)

    def _forget(self, stored: StoredCache) -> None:
        """Drop an entry and free the blocks it owns (a mirror owns its diff, not its
        master); a master takes its mirrors with it."""
        if self._stored.get(stored.key) is not stored:
            return
        del self._stored[stored.key]
        lengths = self._lengths[stored.region_start]
        lengths[stored.num_tokens] -= 1
        if lengths[stored.num_tokens] <= 0:
            del lengths[stored.num_tokens]
        owned = stored.blob if isinstance(stored, StoredMaster) else stored.diff
        if owned is not None:
            self.blobs.discard(owned)
        if isinstance(stored, StoredMaster):
            for key in stored.mirrors:
                mirror = self._stored.get(key)
                if isinstance(mirror, StoredMirror) and mirror.master is stored:
                    self._forget(mirror)

    def _masters(self, tenant: str) -> list[StoredMaster]:
        return [s for s in list(self._stored.values())
                if isinstance(s, StoredMaster) and s.tenant == tenant and self._valid(s)]

    # -- accounting --------------------------------------------------------------------
    def dense_bytes(self, image: CacheImage) -> int:
        """What the image would take kept densely in pool blocks."""
        return -(-image.num_region_tokens // self.kv_cache.block_size) * self.kv_cache.bytes_per_block

    def num_bytes(self, stored: StoredCache) -> int:
        if isinstance(stored, StoredMaster):
            return self.blobs.num_bytes(stored.blob)
        return (self.blobs.num_bytes(stored.diff) if stored.diff else 0) + stored.metadata_bytes

    def stats(self) -> dict[str, int]:
        live = [s for s in list(self._stored.values()) if self._valid(s) is not None]
        masters = [s for s in live if isinstance(s, StoredMaster)]
        mirrors = [s for s in live if isinstance(s, StoredMirror)]
        return {"masters": len(masters), "mirrors": len(mirrors),
                "master_bytes": sum(self.num_bytes(s) for s in masters),
                "mirror_bytes": sum(self.num_bytes(s) for s in mirrors),
                "mirror_touched_blocks": sum(m.num_touched for m in mirrors)}
