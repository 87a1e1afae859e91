"""RoPE shift of cached keys as one Triton kernel.

Shifting cached keys is memory-bound: each key is read once and written once, with a
handful of flops per element in between. The torch reference (`shift_keys_torch`) makes
about six passes over the keys (fp32 copy, cos/sin tables, rotate_half's cat, the
products, the final cat and cast); this kernel does the one read and the one write,
computes cos/sin in registers once per token and shares them across the token's heads.

Semantics are exactly those of `shift_keys_torch`: angles delta * inv_freq in fp32, the
rotate_half convention (channel i pairs with i + rotary_dim/2), the rotation in fp32,
output in keys' dtype, channels past rotary_dim copied unchanged.

This module imports triton at the top, so it is only ever imported lazily (by
`engine_ext.kernels.rope_shift.shift_keys` after `engine_ext.kernels.triton_available()`). It also runs on CPU
tensors under TRITON_INTERPRET=1, which must be set before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Heads handled by one program: enough to share a token's cos/sin across all its
# KV heads in usual models (1 to 16 KV heads), small enough to keep the tile in registers.
MAX_BLOCK_H = 16


@triton.jit
def _shift_keys_kernel(
    keys_ptr: tl.tensor,
    out_ptr: tl.tensor,
    delta_ptr: tl.tensor,
    inv_freq_ptr: tl.tensor,
    num_heads: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_kd: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
) -> None:
    """One program per (token, block of BLOCK_H heads); output rows are contiguous."""
    token = tl.program_id(0).to(tl.int64)  # int64: token * stride can pass 2**31 in a large cache
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    pairs = tl.arange(0, BLOCK_HALF)  # (BLOCK_HALF,): pair i is channels (i, i + HALF)
    head_mask = heads < num_heads
    pair_mask = pairs < HALF

    # The same fp32 angles as rope_cos_sin: float(delta) * inv_freq.
    delta = tl.load(delta_ptr + token).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + pairs, mask=pair_mask, other=0.0)  # (BLOCK_HALF,)
    angle = delta * inv_freq
    cos = tl.cos(angle)[None, :]  # (1, BLOCK_HALF), broadcast over the heads
    sin = tl.sin(angle)[None, :]

    k_row = keys_ptr + token * stride_kt + heads[:, None] * stride_kh  # (BLOCK_H, 1) pointers
    o_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh  # (BLOCK_H, 1) pointers
    mask = head_mask[:, None] & pair_mask[None, :]  # (BLOCK_H, BLOCK_HALF)
    x1 = tl.load(k_row + pairs[None, :] * stride_kd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + (pairs[None, :] + HALF) * stride_kd, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), one half at a time.
    out1 = x1 * cos - x2 * sin  # (BLOCK_H, BLOCK_HALF)
    out2 = x2 * cos + x1 * sin
    tl.store(o_row + pairs[None, :], out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + pairs[None, :] + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)

    if TAIL > 0:  # partial rotary: channels past rotary_dim carry no position
        rest = 2 * HALF + tl.arange(0, BLOCK_TAIL)  # (BLOCK_TAIL,) channel indices
        tail_mask = head_mask[:, None] & (rest < 2 * HALF + TAIL)[None, :]  # (BLOCK_H, BLOCK_TAIL)
        x = tl.load(k_row + rest[None, :] * stride_kd, mask=tail_mask)
        tl.store(o_row + rest[None, :], x, mask=tail_mask)


def shift_keys_triton(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """keys (n, kv_heads, head_dim) rotated for their old positions, any float dtype and
    strides; delta (n,) integer position change per key; inv_freq (rotary_dim/2,).
    Returns new contiguous keys rotated by delta more, in keys' dtype."""
    if keys.dim() != 3:
        raise ValueError(f"keys must be (n, kv_heads, head_dim), got shape {tuple(keys.shape)}")
    n, num_heads, head_dim = keys.shape
    half = inv_freq.shape[0]
    if delta.shape != (n,):
        raise ValueError(f"delta must have shape ({n},), got {tuple(delta.shape)}")
    if inv_freq.dim() != 1 or 2 * half > head_dim:
        raise ValueError(f"inv_freq must be (rotary_dim/2,) with rotary_dim <= {head_dim}")
    if delta.device != keys.device or inv_freq.device != keys.device:
        raise ValueError("keys, delta and inv_freq must be on the same device")
    if half == 0 or keys.numel() == 0:
        return keys.clone(memory_format=torch.contiguous_format)

    out = torch.empty((n, num_heads, head_dim), dtype=keys.dtype, device=keys.device)
    delta = delta.to(torch.int64).contiguous()
    inv_freq = inv_freq.to(torch.float32).contiguous()
    tail = head_dim - 2 * half
    block_h = min(triton.next_power_of_2(num_heads), MAX_BLOCK_H)
    grid = (n, triton.cdiv(num_heads, block_h))
    _shift_keys_kernel[grid](
        keys, out, delta, inv_freq,
        num_heads,
        keys.stride(0), keys.stride(1), keys.stride(2),
        out.stride(0), out.stride(1),
        HALF=half,
        TAIL=tail,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)),
    )
    return out
