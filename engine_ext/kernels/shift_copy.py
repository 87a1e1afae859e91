"""Batched RoPE shift with a paged gather/scatter: the torch reference (used on CPU) and
the dispatch to the Triton kernel on CUDA devices when triton is installed.

One All-Gather round of TokenDance moves many segments of many requests to new
positions in the paged KV cache at once: every moved token is read from its source slot,
its key rotated by its own position delta, and written to its destination slot. Doing
this per segment per request costs one gather, one rotation and one scatter (and their
launches) each time; `shift_copy` takes the whole round as three flat (n,) tensors, so
the round is one call (TokenDance's batched RoPE pass). On CUDA the Triton kernel reads
each source row once and writes each destination row once, with no intermediate tensors.
"""

from __future__ import annotations

import torch

from engine_ext.kernels.rope_shift import shift_keys_torch


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """The checks every paged-cache kernel makes on one layer's caches and inv_freq.
    Raises ValueError naming the offending argument."""
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache must be (num_slots, kv_heads, head_dim), got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > k_cache.shape[2]:
        raise ValueError(f"inv_freq must be (rotary_dim/2,) with rotary_dim <= {k_cache.shape[2]}")
    if v_cache.device != k_cache.device or inv_freq.device != k_cache.device:
        raise ValueError("k_cache, v_cache and inv_freq must be on the same device")


def check_shift_copy_args(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """Shape and device checks shared by the reference and the Triton wrapper, so both
    reject the same calls with the same messages. Slot values are not bounds-checked:
    on CUDA that would cost a host sync per call."""
    check_caches(k_cache, v_cache, inv_freq)
    if src.dim() != 1:
        raise ValueError(f"src must be (n,), got shape {tuple(src.shape)}")
    n = src.shape[0]
    for name, t in (("dst", dst), ("delta", delta)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) like src, got {tuple(t.shape)}")
    if any(t.device != k_cache.device for t in (src, dst, delta)):
        raise ValueError("src, dst and delta must be on the caches' device")


def shift_copy_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """In place, for every i: k_cache[dst[i]] = k_cache[src[i]] rotated by delta[i] and
    v_cache[dst[i]] = v_cache[src[i]] (values carry no position, so they are never rotated).

    k_cache, v_cache (num_slots, kv_heads, head_dim); src, dst, delta (n,) int64; inv_freq
    (rotary_dim/2,) fp32. dst entries must be distinct (index_copy_ with repeated indices
    keeps an unspecified one) and disjoint from src: all sources are read before any
    destination is written here, but the Triton kernel moves rows in no set order.
    Exactly index_select, `shift_keys_torch`, index_copy_: the definition the kernel is
    tested against.
    """
    check_shift_copy_args(k_cache, v_cache, src, dst, delta, inv_freq)
    keys = shift_keys_torch(k_cache.index_select(0, src), delta, inv_freq)  # (n, kv_heads, D)
    values = v_cache.index_select(0, src)  # (n, kv_heads, D)
    k_cache.index_copy_(0, dst, keys)
    v_cache.index_copy_(0, dst, values)


def shift_copy(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """Move rows src -> dst, keys rotated by delta: Triton on CUDA, the torch reference elsewhere."""
    if k_cache.is_cuda:
        from engine_ext.kernels import triton_available

        if triton_available():
            from engine_ext.kernels.shift_copy_triton import shift_copy_triton

            shift_copy_triton(k_cache, v_cache, src, dst, delta, inv_freq)
            return
    shift_copy_torch(k_cache, v_cache, src, dst, delta, inv_freq)
