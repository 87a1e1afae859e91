"""The tensor side of KVCOMM: distances between samples, measured and applied offsets.

Everything reads and writes the paged KV cache by slot: a sample's base KV, an anchor's
base and offsets all live in cache blocks (kv/blobs.py). Layer 0 is skipped throughout:
its keys and values are a function of the token alone, so a shared text's layer-0 KV
has no offset to measure or correct (after the RoPE shift it is already exact).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.kv.cache import KVCache
from engine_ext.rope import RopeShifter
from engine_ext.kernels.rope import apply_rotary, rope_cos_sin


def _corrected_layers(kv_cache: KVCache) -> range:
    num_layers = len(kv_cache.layers)
    return range(1, num_layers) if num_layers > 1 else range(num_layers)


def token_distances(kv_cache: KVCache, sample: torch.Tensor, anchors: list[torch.Tensor]) -> torch.Tensor:
    """Per token, the L2 distance between the sample's base values and each anchor's
    (over all corrected layers, heads and dims; the anchor truncated to the sample's
    length): (A, n). Values carry no position, so samples compare wherever computed."""
    n = sample.shape[0]
    stacked = torch.cat([slots[:n] for slots in anchors])  # (A * n,)
    squares = torch.zeros(len(anchors), n)  # (A, n)
    for layer in _corrected_layers(kv_cache):
        v_cache = kv_cache.layers[layer][1]
        mine = v_cache.index_select(0, sample).float()  # (n, kv_heads, D)
        theirs = v_cache.index_select(0, stacked).float().view(len(anchors), n, *mine.shape[1:])  # (A, n, kv_heads, D)
        squares += (theirs - mine).pow(2).sum(dim=(-2, -1))
    return squares.sqrt()


def sample_distances(token_dist: torch.Tensor) -> torch.Tensor:
    """The whole sample's L2 distance to each anchor, (A,), from per-token ones (A, n)."""
    return token_dist.pow(2).sum(dim=1).sqrt()


def measure(kv_cache: KVCache, shifter: RopeShifter, real: torch.Tensor, positions: torch.Tensor,
            base: torch.Tensor, out: torch.Tensor) -> None:
    """Write real - base into slots `out` (all (N,)): `real` holds texts' KV computed in
    a prompt, token t's text starting at `positions[t]`, `base` their canonical KV. Keys
    are rotated back to the canonical frame first (each by its own text's start), so what
    is stored is the offset alone, free of position. Many chunks go in one call: one pass
    of a few tensor ops per layer, whatever their number."""
    device = kv_cache.layers[0][0].device
    cos, sin = rope_cos_sin(shifter.inv_freq.to(device), -positions.to(device))  # each (N, rotary_dim)
    real, base, out = real.to(device), base.to(device), out.to(device)
    for k_cache, v_cache in kv_cache.layers:
        keys = apply_rotary(k_cache.index_select(0, real).float(), cos, sin)  # (N, kv_heads, D)
        k_cache.index_copy_(0, out, (keys - k_cache.index_select(0, base).float()).to(k_cache.dtype))
        values = v_cache.index_select(0, real).float() - v_cache.index_select(0, base).float()
        v_cache.index_copy_(0, out, values.to(v_cache.dtype))


class Correction(NamedTuple):
    """A weighted sum of stored offsets to add to a placed segment's KV."""

    offsets: list[torch.Tensor]  # per anchor, the slots of its offset for these tokens (n,)
    weights: torch.Tensor  # (A, n) per token, or (A,) for the whole segment

    def pieces(self, dst: torch.Tensor, position: int) -> list[Piece]:
        return [Piece(self, dst, position)]

    def apply(self, kv_cache: KVCache, shifter: RopeShifter, dst: torch.Tensor, position: int) -> None:
        """Add the offsets to the KV at slots `dst` (n,), which start at `position`."""
        apply_corrections(kv_cache, shifter, self.pieces(dst, position))


class ChunkedCorrection(NamedTuple):
    """A placeholder's corrections, one per chunk (each predicted from its own anchors,
    bank.py), applied where each chunk lands."""

    chunks: list[tuple[int, Correction]]  # (first token of the chunk within the segment, its correction)

    def pieces(self, dst: torch.Tensor, position: int) -> list[Piece]:
        """Each chunk's correction with its part of the slots `dst` (n,), which start at `position`."""
        bounds = [start for start, _ in self.chunks[1:]] + [dst.shape[0]]
        return [Piece(correction, dst[start:end], position + start)
                for (start, correction), end in zip(self.chunks, bounds)]

    def apply(self, kv_cache: KVCache, shifter: RopeShifter, dst: torch.Tensor, position: int) -> None:
        apply_corrections(kv_cache, shifter, self.pieces(dst, position))


class Piece(NamedTuple):
    """One correction and where it lands: slots `dst` (n,), the first at `position`."""

    correction: Correction
    dst: torch.Tensor
    position: int


def apply_corrections(kv_cache: KVCache, shifter: RopeShifter, pieces: list[Piece]) -> None:
    """Add every piece's weighted offsets to the KV at its slots, all pieces in one pass
    per layer. Keys get each offset rotated by its piece's start (offsets are stored in
    their chunk's own frame; RoPE is linear, so shifting base and offset apart equals
    shifting their sum).

    A request places dozens of chunks, each with its own anchors; applied chunk by
    chunk, layer by layer, that was tens of thousands of small tensor ops (a quarter of a
    second per request on 2 cores, more than the tokens it computed). Batched, the
    pieces' anchors are padded to the widest (weight 0 on a valid slot adds exact zeros)."""
    pieces = [p for p in pieces if p.dst.numel()]
    if not pieces:
        return
    width = max(len(p.correction.offsets) for p in pieces)
    slots, weights = [], []
    for piece in pieces:
        n = piece.dst.shape[0]
        w = piece.correction.weights.float()
        w = w if w.dim() == 2 else w[:, None].expand(-1, n)  # (A, n)
        s = torch.stack([slots_[:n] for slots_ in piece.correction.offsets])  # (A, n)
        if (pad := width - s.shape[0]) > 0:
            s = torch.cat((s, s[:1].expand(pad, n)))
            w = torch.cat((w, w.new_zeros(pad, n)))
        slots.append(s)
        weights.append(w)
    device = kv_cache.layers[0][0].device
    stacked = torch.cat(slots, dim=1).reshape(-1).to(device)  # (width * N,)
    weight = torch.cat(weights, dim=1).to(device)  # (width, N)
    dst = torch.cat([p.dst for p in pieces]).to(device)  # (N,)
    starts = torch.cat([torch.full((p.dst.shape[0],), p.position, dtype=torch.long) for p in pieces])  # (N,)
    cos, sin = rope_cos_sin(shifter.inv_freq.to(device), starts.to(device))  # each (N, rotary_dim)
    for layer in _corrected_layers(kv_cache):
        k_cache, v_cache = kv_cache.layers[layer]
        dk = _weighted_sum(k_cache, stacked, weight)  # (N, kv_heads, D) fp32
        dv = _weighted_sum(v_cache, stacked, weight)
        keys = k_cache.index_select(0, dst).float() + apply_rotary(dk, cos, sin)
        k_cache.index_copy_(0, dst, keys.to(k_cache.dtype))
        v_cache.index_copy_(0, dst, (v_cache.index_select(0, dst).float() + dv).to(v_cache.dtype))


def _weighted_sum(cache: torch.Tensor, stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over anchors a of weights[a, t] * cache[offset slot of a at t]: (n, kv_heads, D)."""
    num_anchors, n = weights.shape
    rows = cache.index_select(0, stacked).float().view(num_anchors, n, -1)  # (A, n, kv_heads * D)
    return torch.einsum("an,anx->nx", weights, rows).view(n, *cache.shape[1:])
