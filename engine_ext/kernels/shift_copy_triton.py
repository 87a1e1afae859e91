"""Batched RoPE shift with a paged gather/scatter as one Triton kernel.

`shift_copy_torch` gathers the source rows into a new tensor, rotates them through the
six passes of `shift_keys_torch`, then scatters them: every byte crosses memory several
times. This kernel reads each source row of K and V once and writes its destination row
once, computing cos/sin in registers once per token and sharing them across its heads.

Semantics are exactly those of `shift_copy_torch`: angles float(delta) * inv_freq in
fp32, the rotate_half convention (channel i pairs with i + rotary_dim/2), the rotation in
fp32, keys stored in the cache dtype, channels past rotary_dim and all of V copied bit
for bit. Rows move in no set order, hence dst must be distinct and disjoint from src.

`move_rows` is also the row mover of engine_ext/kernels/diff_restore_triton.py. This module imports
triton at the top, so it is only ever imported lazily (after `engine_ext.kernels.triton_available()`);
under TRITON_INTERPRET=1, set before the import, it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_ext.kernels.shift_copy import check_shift_copy_args

# (token, head) rows in one tile, split between tokens and heads so that few-head models
# still move 8 rows per tile. Each row carries its whole V row besides the K halves, so 16
# rows (shift_keys_triton's budget) take 128 registers a thread at head_dim 128 (ptxas,
# sm_90, bf16, 4 warps); 8 rows take 30 to 100, depending on the token/head split.
TILE_ROWS = 8


@triton.jit
def move_rows(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    src: tl.tensor,
    dst: tl.tensor,
    delta: tl.tensor,
    inv_freq_ptr: tl.tensor,
    token_mask: tl.tensor,
    heads: tl.tensor,
    num_heads: tl.tensor,
    stride_slot: tl.tensor,
    stride_head: tl.tensor,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTATE: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    """Move the K and V rows of BLOCK_T tokens x BLOCK_H heads from slots src to slots
    dst. src, dst, delta, token_mask are (BLOCK_T,), heads (BLOCK_H,). With ROTATE the
    keys are rotated by delta; without it both rows are copied bit for bit."""
    # int64 slots: slot * stride_slot can pass 2**31 in a large cache.
    head_off = (heads * stride_head)[None, :, None]  # (1, BLOCK_H, 1)
    src_row = (src.to(tl.int64) * stride_slot)[:, None, None] + head_off  # (BLOCK_T, BLOCK_H, 1)
    dst_row = (dst.to(tl.int64) * stride_slot)[:, None, None] + head_off  # (BLOCK_T, BLOCK_H, 1)
    row_mask = token_mask[:, None, None] & (heads < num_heads)[None, :, None]  # (BLOCK_T, BLOCK_H, 1)
    channels = tl.arange(0, BLOCK_D)[None, None, :]  # (1, 1, BLOCK_D)

    # Values carry no position: always the whole row, unchanged.
    full = row_mask & (channels < HEAD_DIM)  # (BLOCK_T, BLOCK_H, BLOCK_D)
    tl.store(v_ptr + dst_row + channels, tl.load(v_ptr + src_row + channels, mask=full), mask=full)

    if ROTATE:
        pairs = tl.arange(0, BLOCK_HALF)  # (BLOCK_HALF,): pair i is channels (i, i + HALF)
        inv_freq = tl.load(inv_freq_ptr + pairs, mask=pairs < HALF, other=0.0)
        # The same fp32 angles as rope_cos_sin: float(delta) * inv_freq.
        angle = delta.to(tl.float32)[:, None] * inv_freq[None, :]  # (BLOCK_T, BLOCK_HALF)
        cos = tl.cos(angle)[:, None, :]  # (BLOCK_T, 1, BLOCK_HALF), broadcast over the heads
        sin = tl.sin(angle)[:, None, :]
        p = pairs[None, None, :]
        pair_mask = row_mask & (p < HALF)  # (BLOCK_T, BLOCK_H, BLOCK_HALF)
        x1 = tl.load(k_ptr + src_row + p, mask=pair_mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_ptr + src_row + p + HALF, mask=pair_mask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), one half at a time.
        out_ty = k_ptr.dtype.element_ty
        tl.store(k_ptr + dst_row + p, (x1 * cos - x2 * sin).to(out_ty), mask=pair_mask)
        tl.store(k_ptr + dst_row + p + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=pair_mask)
        # Partial rotary: channels past rotary_dim carry no position.
        tail = full & (channels >= 2 * HALF)  # (BLOCK_T, BLOCK_H, BLOCK_D)
        tl.store(k_ptr + dst_row + channels, tl.load(k_ptr + src_row + channels, mask=tail), mask=tail)
    else:
        tl.store(k_ptr + dst_row + channels, tl.load(k_ptr + src_row + channels, mask=full), mask=full)


@triton.jit
def _shift_copy_kernel(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    delta_ptr: tl.tensor,
    inv_freq_ptr: tl.tensor,
    n: tl.tensor,
    num_heads: tl.tensor,
    stride_slot: tl.tensor,
    stride_head: tl.tensor,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    """One program per (BLOCK_T tokens, BLOCK_H heads)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    token_mask = tokens < n
    src = tl.load(src_ptr + tokens, mask=token_mask, other=0)
    dst = tl.load(dst_ptr + tokens, mask=token_mask, other=0)
    delta = tl.load(delta_ptr + tokens, mask=token_mask, other=0)
    move_rows(
        k_ptr, v_ptr, src, dst, delta, inv_freq_ptr, token_mask, heads, num_heads,
        stride_slot, stride_head,
        HALF=HALF, HEAD_DIM=HEAD_DIM, ROTATE=True, BLOCK_HALF=BLOCK_HALF, BLOCK_D=BLOCK_D,
    )


def tile_shape(num_heads: int, max_tokens: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_H) for a tile of TILE_ROWS rows: all heads of a token when they fit
    (a token's cos/sin are then computed once), the rest of the rows spent on more tokens,
    never more tokens than max_tokens (rounded up to a power of two)."""
    block_h = min(triton.next_power_of_2(num_heads), TILE_ROWS)
    block_t = min(TILE_ROWS // block_h, triton.next_power_of_2(max(max_tokens, 1)))
    return block_t, block_h


def shift_copy_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """In place, for every i: k_cache[dst[i]] = k_cache[src[i]] rotated by delta[i] and
    v_cache[dst[i]] = v_cache[src[i]]. Caches (num_slots, kv_heads, head_dim), contiguous,
    any float dtype; src, dst, delta (n,) integer; inv_freq (rotary_dim/2,). Slots are not
    bounds-checked (a host sync per call): out-of-range ones fault or corrupt memory."""
    check_shift_copy_args(k_cache, v_cache, src, dst, delta, inv_freq)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    n = src.shape[0]
    num_slots, num_heads, head_dim = k_cache.shape
    if n == 0 or num_slots == 0 or num_heads == 0:
        return

    half = inv_freq.shape[0]
    block_t, block_h = tile_shape(num_heads, n)
    grid = (triton.cdiv(n, block_t), triton.cdiv(num_heads, block_h))
    _shift_copy_kernel[grid](
        k_cache, v_cache,
        src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous(),
        delta.to(torch.int64).contiguous(), inv_freq.to(torch.float32).contiguous(),
        n, num_heads,
        k_cache.stride(0), k_cache.stride(1),
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
