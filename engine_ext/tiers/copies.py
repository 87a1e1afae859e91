"""Block copies between the device KV cache and a lower tier's storage.

The device cache is per layer (num_slots, kv_heads, head_dim) for K and for V; a tier
keeps whole blocks, (num_blocks, num_layers, 2, block_size, kv_heads, head_dim). A copy
goes through a staging buffer of a few whole blocks so the tier side is always read or
written one contiguous block at a time (sequential I/O for the disk tier), and the
staging buffer stays small however many blocks move.

The copies run on the transfer worker's thread, so they go through numpy views of the
tensors' bytes, not torch ops: a torch op big enough to parallelise starts an OpenMP
team on the thread that runs it, and with a second thread's team alive libgomp slows
every parallel region of the engine thread (a SmolLM2 decode step by about a third,
measured). numpy copies on the calling thread alone.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_ext.kv.cache import KVCache

STAGING_BLOCKS = 32
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of the tensor's elements as same-sized integers (numpy has no bf16)."""
    return tensor.view(_SAME_SIZE_INT[tensor.element_size()]).numpy()


def _device_blocks(kv_cache: KVCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    k, v = kv_cache.layers[layer]
    shape = (-1, kv_cache.block_size, *k.shape[1:])
    return _raw(k).reshape(shape), _raw(v).reshape(shape)  # (num_blocks, bs, H, D) each


def device_to_tier(kv_cache: KVCache, block_ids: list[int], tier_blocks: torch.Tensor, slots: list[int]) -> None:
    tier = _raw(tier_blocks)  # (N, L, 2, bs, H, D)
    for lo in range(0, len(block_ids), STAGING_BLOCKS):
        ids = np.asarray(block_ids[lo : lo + STAGING_BLOCKS], dtype=np.int64)  # (n,)
        staged = np.empty((len(ids), *tier.shape[1:]), dtype=tier.dtype)  # (n, L, 2, bs, H, D)
        for layer in range(len(kv_cache.layers)):
            k, v = _device_blocks(kv_cache, layer)
            staged[:, layer, 0] = k[ids]
            staged[:, layer, 1] = v[ids]
        for i, slot in enumerate(slots[lo : lo + STAGING_BLOCKS]):
            tier[slot] = staged[i]


def tier_to_device(tier_blocks: torch.Tensor, slots: list[int], kv_cache: KVCache, block_ids: list[int]) -> None:
    tier = _raw(tier_blocks)
    for lo in range(0, len(block_ids), STAGING_BLOCKS):
        ids = np.asarray(block_ids[lo : lo + STAGING_BLOCKS], dtype=np.int64)  # (n,)
        staged = np.stack([tier[slot] for slot in slots[lo : lo + STAGING_BLOCKS]])  # (n, L, 2, bs, H, D)
        for layer in range(len(kv_cache.layers)):
            k, v = _device_blocks(kv_cache, layer)
            k[ids] = staged[:, layer, 0]
            v[ids] = staged[:, layer, 1]


def tier_to_tier(src_blocks: torch.Tensor, src_slots: list[int], dst_blocks: torch.Tensor, dst_slots: list[int]) -> None:
    src, dst = _raw(src_blocks), _raw(dst_blocks)
    for s, d in zip(src_slots, dst_slots):
        dst[d] = src[s]
