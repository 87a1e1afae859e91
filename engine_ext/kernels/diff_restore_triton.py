"""Fused block-sparse diff restore of a mirror KV cache as one Triton kernel.

The dense restore touches every mirror token three times over (gather and rotate the
master rows into a temporary, overwrite the touched blocks, copy into the cache) and the
torch reference still gathers into temporaries. Here one program owns one block of
`block_tokens` tokens (and a block of heads): it loads block_diff[b] once and, for the
whole block, either copies the stored diff rows verbatim (no rotation, no rounding: the
skip) or gathers the master's aligned rows and rotates their keys by delta (the
correction). Each destination row is written once, straight from its source row; padding
rows (dst -1, a block's tail) are masked off: nothing loaded for them, nothing stored.

Semantics are exactly those of `restore_mirror_torch` (engine_ext/kernels/diff_restore.py, whose
module docstring describes the layout); the row moves are `move_rows` of
engine_ext/kernels/shift_copy_triton.py. base_src and delta of touched blocks and of padding are
never loaded; a touched block's token k reads diff_slots[block_diff[b] + k].

This module imports triton at the top, so it is only ever imported lazily (after
`engine_ext.kernels.triton_available()`); under TRITON_INTERPRET=1, set before this module and
kernels.shift_copy_triton are imported, it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_ext.kernels.diff_restore import check_restore_args
from engine_ext.kernels.shift_copy_triton import move_rows, tile_shape


@triton.jit
def _restore_block(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    src_ptr: tl.tensor,
    delta_ptr: tl.tensor,
    inv_freq_ptr: tl.tensor,
    block: tl.tensor,
    src_start: tl.tensor,
    n: tl.tensor,
    heads: tl.tensor,
    num_heads: tl.tensor,
    stride_slot: tl.tensor,
    stride_head: tl.tensor,
    ROTATE: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    """Move the block's real tokens, BLOCK_T at a time; token k of the block reads slot
    src_ptr[src_start + k] (base_src from the block's first token, or diff_slots from the
    block's offset). Padding rows (dst -1) load no source and store nothing."""
    for t0 in range(0, BLOCK_TOKENS, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)  # (BLOCK_T,) token offsets k inside the block
        tokens = block * BLOCK_TOKENS + offs  # (BLOCK_T,) mirror token indices
        in_block = (offs < BLOCK_TOKENS) & (tokens < n)  # the last block may be short
        dst = tl.load(dst_ptr + tokens, mask=in_block, other=-1)  # (BLOCK_T,)
        # A touched block's padding would read past its stored tokens: masked before any load.
        real = in_block & (dst >= 0)  # (BLOCK_T,)
        src = tl.load(src_ptr + src_start + offs, mask=real, other=0)
        if ROTATE:
            delta = tl.load(delta_ptr + tokens, mask=real, other=0)
        else:
            delta = dst  # unused: verbatim rows are not rotated
        move_rows(
            k_ptr, v_ptr, src, dst, delta, inv_freq_ptr, real, heads, num_heads,
            stride_slot, stride_head,
            HALF=HALF, HEAD_DIM=HEAD_DIM, ROTATE=ROTATE, BLOCK_HALF=BLOCK_HALF, BLOCK_D=BLOCK_D,
        )


@triton.jit
def _restore_mirror_kernel(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    base_src_ptr: tl.tensor,
    delta_ptr: tl.tensor,
    block_diff_ptr: tl.tensor,
    diff_slots_ptr: tl.tensor,
    inv_freq_ptr: tl.tensor,
    n: tl.tensor,
    num_heads: tl.tensor,
    stride_slot: tl.tensor,
    stride_head: tl.tensor,
    BLOCK_TOKENS: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    """One program per (block of BLOCK_TOKENS tokens, BLOCK_H heads): one skip-or-correct
    decision per block."""
    block = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    offset = tl.load(block_diff_ptr + block).to(tl.int64)  # -1: untouched, else the block's first stored token
    if offset < 0:  # correct: the master's aligned rows, keys rotated to the mirror's positions
        _restore_block(
            k_ptr, v_ptr, dst_ptr, base_src_ptr, delta_ptr, inv_freq_ptr,
            block, block * BLOCK_TOKENS, n, heads, num_heads, stride_slot, stride_head,
            ROTATE=True, BLOCK_TOKENS=BLOCK_TOKENS, HALF=HALF, HEAD_DIM=HEAD_DIM,
            BLOCK_T=BLOCK_T, BLOCK_HALF=BLOCK_HALF, BLOCK_D=BLOCK_D,
        )
    else:  # skip: the stored rows, verbatim
        _restore_block(
            k_ptr, v_ptr, dst_ptr, diff_slots_ptr, delta_ptr, inv_freq_ptr,
            block, offset, n, heads, num_heads, stride_slot, stride_head,
            ROTATE=False, BLOCK_TOKENS=BLOCK_TOKENS, HALF=HALF, HEAD_DIM=HEAD_DIM,
            BLOCK_T=BLOCK_T, BLOCK_HALF=BLOCK_HALF, BLOCK_D=BLOCK_D,
        )


def restore_mirror_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dst: torch.Tensor,
    base_src: torch.Tensor,
    delta: torch.Tensor,
    block_diff: torch.Tensor,
    diff_slots: torch.Tensor,
    block_tokens: int,
    inv_freq: torch.Tensor,
) -> None:
    """Fused mirror restore, in place. Caches (num_slots, kv_heads, head_dim), contiguous,
    any float dtype; the other arguments as in engine_ext/kernels/diff_restore.py (dst -1: padding).
    Slots and diff offsets are not bounds-checked (a host sync per call): out-of-range
    ones fault or corrupt memory. block_tokens is a compile-time constant: one compile per value."""
    check_restore_args(k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots, block_tokens, inv_freq)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    n = dst.shape[0]
    num_slots, num_heads, head_dim = k_cache.shape
    if n == 0 or num_slots == 0 or num_heads == 0:
        return

    half = inv_freq.shape[0]
    block_t, block_h = tile_shape(num_heads, block_tokens)
    grid = (block_diff.shape[0], triton.cdiv(num_heads, block_h))
    _restore_mirror_kernel[grid](
        k_cache, v_cache,
        dst.to(torch.int64).contiguous(), base_src.to(torch.int64).contiguous(),
        delta.to(torch.int64).contiguous(), block_diff.to(torch.int64).contiguous(),
        diff_slots.to(torch.int64).contiguous(), inv_freq.to(torch.float32).contiguous(),
        n, num_heads,
        k_cache.stride(0), k_cache.stride(1),
        BLOCK_TOKENS=block_tokens,
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
