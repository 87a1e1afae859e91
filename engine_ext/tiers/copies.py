"""Block copies between the device KV cache and a lower tier's storage.

The device cache is per layer (num_slots, kv_heads, head_dim) for K and for V; a tier
keeps whole blocks, (num_blocks, num_layers, 2, block_size, kv_heads, head_dim). A copy
goes through a staging buffer of a few whole blocks so the tier side is always read or
written one contiguous block at a time (sequential I/O for the disk tier), and the
staging buffer stays small however many blocks move.
"""

from __future__ import annotations

import torch

from engine_ext.kv.cache import KVCache

STAGING_BLOCKS = 32


def _device_blocks(kv_cache: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = kv_cache.layers[layer]
    shape = (-1, kv_cache.block_size, *k.shape[1:])
    return k.view(shape), v.view(shape)  # (num_blocks, bs, H, D) each


def device_to_tier(kv_cache: KVCache, block_ids: list[int], tier_blocks: torch.Tensor, slots: list[int]) -> None:
    for lo in range(0, len(block_ids), STAGING_BLOCKS):
        ids = torch.tensor(block_ids[lo : lo + STAGING_BLOCKS], dtype=torch.long)  # (n,)
        staged = torch.empty((len(ids), *tier_blocks.shape[1:]), dtype=tier_blocks.dtype)  # (n, L, 2, bs, H, D)
        for layer in range(len(kv_cache.layers)):
            k, v = _device_blocks(kv_cache, layer)
            staged[:, layer, 0] = k[ids]
            staged[:, layer, 1] = v[ids]
        for i, slot in enumerate(slots[lo : lo + STAGING_BLOCKS]):
            tier_blocks[slot] = staged[i]


def tier_to_device(tier_blocks: torch.Tensor, slots: list[int], kv_cache: KVCache, block_ids: list[int]) -> None:
    for lo in range(0, len(block_ids), STAGING_BLOCKS):
        ids = torch.tensor(block_ids[lo : lo + STAGING_BLOCKS], dtype=torch.long)  # (n,)
        staged = torch.stack([tier_blocks[slot] for slot in slots[lo : lo + STAGING_BLOCKS]])  # (n, L, 2, bs, H, D)
        for layer in range(len(kv_cache.layers)):
            k, v = _device_blocks(kv_cache, layer)
            k[ids] = staged[:, layer, 0]
            v[ids] = staged[:, layer, 1]


def tier_to_tier(src_blocks: torch.Tensor, src_slots: list[int], dst_blocks: torch.Tensor, dst_slots: list[int]) -> None:
    for src, dst in zip(src_slots, dst_slots):
        dst_blocks[dst] = src_blocks[src]
