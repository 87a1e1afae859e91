"""What the DiffStore holds (masters and mirrors) and the lazy views it hands out.

A master is one prompt's region stored densely in pool blocks: each token either in
the canonical frame (a segment's own KV, `ref` = its offset in the segment) or
verbatim (`ref` = its position). A mirror holds no dense copy. Its region rows are laid
out in blocks of `block_tokens` that follow the prompt's structure (`layout`: each
segment and each stretch between segments starts a block, the last one padded with
-1); per layout position it holds the master row it equals once moved to the mirror's
position (or -1), and per block either nothing (every token equals its master row) or
the block's tokens verbatim (a touched block). One list (`block_diff`, the offset of
each touched block's rows in the diff) serves K and V.

Reading returns a view: a reference to the stored rows plus the metadata, nothing
materialised. `restore` writes the region into a sequence's slots in one pass per
layer, applying the diff while it copies the master (engine_ext.kernels.diff_restore);
`restore_dense` is the naive path that builds the whole mirror first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine_ext.kv.blobs import Blob
from engine_ext.kv.hashing import DEFAULT_TENANT
from engine_ext.kernels.diff_restore import restore_mirror, restore_mirror_dense
from engine_ext.kernels.shift_copy import shift_copy

LayerCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StoredMaster:
    key: bytes
    num_tokens: int  # of the whole prompt
    region_start: int
    blob: Blob  # the region's KV, one row per region token
    ref: torch.Tensor  # (n,) the position each stored key is rotated for
    tokens: torch.Tensor  # (n,) the region's token ids
    index: dict[tuple[bytes, int], int]  # (segment key, offset) -> region row, for canonical rows
    mirrors: list[bytes] = field(default_factory=list)  # keys of the mirrors stored against it
    tenant: str = DEFAULT_TENANT  # its mirrors are that tenant's too


class MirrorRows(NamedTuple):
    """Why a mirror's rows are stored verbatim. `unshared`: no master row holds the same
    segment at the same offset or the same token at the same position (a member's own
    text: the floor of a lossless mirror); `differing`: a master row was a candidate but
    its values, moved here, differ (positions the round recomputed per member, text
    after them); `alongside`: equal to their master row, stored because a row of their
    block is not."""

    unshared: int = 0
    differing: int = 0
    alongside: int = 0

    def plus(self, other: MirrorRows) -> MirrorRows:
        return MirrorRows(*(a + b for a, b in zip(self, other, strict=True)))


@dataclass
class StoredMirror:
    key: bytes
    num_tokens: int
    region_start: int
    master: StoredMaster
    layout: torch.Tensor  # (m,) region row at each layout position, -1 for padding; m = num_blocks * block_tokens
    base: torch.Tensor  # (m,) master region row each position equals (moved), or -1
    delta: torch.Tensor  # (m,) rotation from the master row's frame to this position's token
    block_diff: torch.Tensor  # (num_blocks,) -1: block equals the master; else its rows' offset in the diff
    diff: Blob | None  # the touched blocks' tokens, verbatim, block after block (padding left out)
    block_tokens: int
    rows: MirrorRows = MirrorRows()  # why the rows in `diff` are there

    @property
    def num_touched(self) -> int:
        return int((self.block_diff >= 0).sum())

    def row_bases(self) -> torch.Tensor:
        """(n,) per region row, in prompt order, the master row it equals (moved), or -1."""
        real = self.layout >= 0
        bases = torch.full((self.num_tokens - self.region_start,), -1, dtype=torch.long)
        bases[self.layout[real]] = self.base[real]
        return bases

    @property
    def metadata_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.layout, self.base, self.delta, self.block_diff))


class MasterView(NamedTuple):
    """A stored master, read lazily: restoring rotates canonical rows to their positions."""

    num_tokens: int
    region_start: int
    src: torch.Tensor  # (n,) slots of the master's rows
    delta: torch.Tensor  # (n,) position minus ref, per row
    inv_freq: torch.Tensor

    def restore(self, layers: LayerCaches, dst: torch.Tensor) -> None:
        """Write the region into slots dst (n,)."""
        for k_cache, v_cache in layers:
            shift_copy(k_cache, v_cache, self.src, dst, self.delta, self.inv_freq)

    def restore_dense(self, layers: LayerCaches, dst: torch.Tensor) -> None:
        """The same as `restore`: a master has no diff to apply, so both paths are one copy."""
        self.restore(layers, dst)


class MirrorView(NamedTuple):
    """A stored mirror, read lazily: the master's rows plus the block-sparse diff."""

    num_tokens: int
    region_start: int
    layout: torch.Tensor  # (m,) region row per layout position, -1: padding
    base_src: torch.Tensor  # (m,) slot of the master row each position equals, or -1
    delta: torch.Tensor  # (m,)
    block_diff: torch.Tensor  # (num_blocks,)
    diff_slots: torch.Tensor  # (num_stored,) slots of the stored tokens
    block_tokens: int
    inv_freq: torch.Tensor

    def _targets(self, dst: torch.Tensor) -> torch.Tensor:
        """Per layout position, the slot it restores into (dst (n,) holds the region's slots); -1: padding."""
        return torch.where(self.layout >= 0, dst[self.layout.clamp(min=0)], -1)  # (m,)

    def restore(self, layers: LayerCaches, dst: torch.Tensor) -> None:
        """Fused: each block is copied from the diff or moved from the master, straight into dst."""
        targets = self._targets(dst)
        for k_cache, v_cache in layers:
            restore_mirror(k_cache, v_cache, targets, self.base_src, self.delta, self.block_diff, self.diff_slots,
                           self.block_tokens, self.inv_freq)

    def restore_dense(self, layers: LayerCaches, dst: torch.Tensor) -> None:
        """Naive: materialise the dense mirror in a temporary, then copy it into dst."""
        targets = self._targets(dst)
        for k_cache, v_cache in layers:
            restore_mirror_dense(k_cache, v_cache, targets, self.base_src, self.delta, self.block_diff,
                                 self.diff_slots, self.block_tokens, self.inv_freq)


StoredCache = StoredMaster | StoredMirror
CacheView = MasterView | MirrorView
