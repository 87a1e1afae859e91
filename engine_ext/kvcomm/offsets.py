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


def measure(kv_cache: KVCache, shifter: RopeShifter, real: torch.Tensor, position: int,
            base: torch.Tensor, out: torch.Tensor) -> None:
    """Write real - base into slots `out` (all (n,)): `real` holds the text's KV computed
    at `position` in a prompt, `base` its canonical KV. Keys are rotated back to the
    canonical frame first, so what is stored is the offset alone, free of position."""
    for layer in range(len(kv_cache.layers)):
        k_cache, v_cache = kv_cache.layers[layer]
        keys = shifter.shift(k_cache.index_select(0, real).float(), -position)  # (n, kv_heads, D)
        k_cache.index_copy_(0, out, (keys - k_cache.index_select(0, base).float()).to(k_cache.dtype))
        values = v_cache.index_select(0, real).float() - v_cache.index_select(0, base).float()
        v_cache.index_copy_(0, out, values.to(v_cache.dtype))


class Correction(NamedTuple):
    """A weighted sum of stored offsets to add to a placed segment's KV."""

    offsets: list[torch.Tensor]  # per anchor, the slots of its offset for these tokens (n,)
    weights: torch.Tensor  # (A, n) per token, or (A,) for the whole segment

    def apply(self, kv_cache: KVCache, shifter: RopeShifter, dst: torch.Tensor, position: int) -> None:
        """Add the offsets to the KV at slots `dst` (n,), which start at `position`; keys
        get the offset rotated to that position (RoPE is linear, so shifting base and
        offset apart equals shifting their sum)."""
        n = dst.shape[0]
        weights = self.weights if self.weights.dim() == 2 else self.weights[:, None].expand(-1, n)  # (A, n)
        stacked = torch.cat([slots[:n] for slots in self.offsets])  # (A * n,)
        for layer in _corrected_layers(kv_cache):
            k_cache, v_cache = kv_cache.layers[layer]
            dk = _weighted_sum(k_cache, stacked, weights)  # (n, kv_heads, D) fp32
            dv = _weighted_sum(v_cache, stacked, weights)
            keys = k_cache.index_select(0, dst).float() + shifter.shift(dk, position)
            k_cache.index_copy_(0, dst, keys.to(k_cache.dtype))
            v_cache.index_copy_(0, dst, (v_cache.index_select(0, dst).float() + dv).to(v_cache.dtype))


def _weighted_sum(cache: torch.Tensor, stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over anchors a of weights[a, t] * cache[offset slot of a at t]: (n, kv_heads, D)."""
    num_anchors, n = weights.shape
    rows = cache.index_select(0, stacked).float().view(num_anchors, n, -1)  # (A, n, kv_heads * D)
    return torch.einsum("an,anx->nx", weights.float(), rows).view(n, *cache.shape[1:])


class ChunkedCorrection(NamedTuple):
    """A placeholder's corrections, one per chunk (each predicted from its own anchors,
    bank.py), applied where each chunk lands."""

    chunks: list[tuple[int, Correction]]  # (first token of the chunk within the segment, its correction)

    def apply(self, kv_cache: KVCache, shifter: RopeShifter, dst: torch.Tensor, position: int) -> None:
        """Add each chunk's offsets to its part of the slots `dst` (n,), which start at `position`."""
        bounds = [start for start, _ in self.chunks[1:]] + [dst.shape[0]]
        for (start, correction), end in zip(self.chunks, bounds):
            correction.apply(kv_cache, shifter, dst[start:end], position + start)
