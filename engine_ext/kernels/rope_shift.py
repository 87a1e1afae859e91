"""RoPE shift of cached keys: the torch reference (used on CPU) and the dispatch to the
Triton kernel on CUDA devices when triton is installed."""

from __future__ import annotations

import torch

from engine_ext.kernels.rope import apply_rotary, rope_cos_sin


def shift_keys_torch(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """keys (n, kv_heads, head_dim) rotated for their old positions; delta (n,) integer
    position change per key; inv_freq (rotary_dim/2,) fp32. Returns the keys rotated by
    delta more, in keys' dtype (the rotation itself runs in fp32)."""
    cos, sin = rope_cos_sin(inv_freq, delta)  # each (n, rotary_dim)
    return apply_rotary(keys, cos, sin)


def shift_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Shift keys by per-key position deltas: Triton on CUDA, the torch reference elsewhere."""
    if keys.is_cuda:
        from engine_ext.kernels import triton_available

        if triton_available():
            from engine_ext.kernels.rope_shift_triton import shift_keys_triton

            return shift_keys_triton(keys, delta, inv_freq)
    return shift_keys_torch(keys, delta, inv_freq)
