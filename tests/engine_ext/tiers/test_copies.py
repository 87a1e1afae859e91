"""Block copies between the device cache and a tier, in every dtype the engine serves
(they go through numpy views of the bytes, and numpy has no bf16)."""

from __future__ import annotations

import pytest
import torch

from engine_ext.tiers.copies import device_to_tier, tier_to_device, tier_to_tier


class _Cache:
    block_size = 4

    def __init__(self, dtype: torch.dtype, num_blocks: int = 6, layers: int = 3) -> None:
        shape = (num_blocks * self.block_size, 2, 8)  # (slots, kv_heads, head_dim)
        self.layers = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_go_to_a_tier_and_back_bit_for_bit(dtype):
    src, dst = _Cache(dtype), _Cache(dtype)
    tier = torch.zeros((5, 3, 2, 4, 2, 8), dtype=dtype)  # (N, L, 2, bs, H, D)
    device_to_tier(src, [4, 1], tier, [0, 3])
    other = torch.zeros_like(tier)
    tier_to_tier(tier, [0, 3], other, [2, 1])
    tier_to_device(other, [2, 1], dst, [0, 5])
    for (k0, v0), (k1, v1) in zip(src.layers, dst.layers):
        for a, b in ((k0, k1), (v0, v1)):
            assert torch.equal(b[0:4], a[16:20]) and torch.equal(b[20:24], a[4:8])
