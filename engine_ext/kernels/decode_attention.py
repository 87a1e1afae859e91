"""Decode attention straight from the paged KV cache, on the compiled kernel
(engine_ext/kernels/decode_attention.cpp).

One query per sequence reads its keys and values where they sit in the cache, by slot:
no padded gather, no mask. Each sequence's result is bitwise the same alone or batched.
Used for fp32 caches where the kernel library loads, with head sizes of whole vectors
(a multiple of 16, up to 256) and up to 8 query heads per KV head; otherwise
`decode_attention` returns None and the caller runs torch's path.
"""

from __future__ import annotations

import torch

from engine_ext.kernels.compiled import kernels

MAX_DIM = 256  # the kernel's largest head size
MAX_GROUP = 8  # and most query heads per KV head


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q (B, H, D); caches (num_slots, KVH, D); slots (B, Lmax) int64, the first lengths[b]
    real; returns (B, H, D), or None where the kernel does not apply."""
    batch, heads, dim = q.shape
    if (q.dtype != torch.float32 or k_cache.dtype != torch.float32 or torch.is_grad_enabled() or dim % 16
            or dim > MAX_DIM or heads % k_cache.shape[1] or heads // k_cache.shape[1] > MAX_GROUP):
        return None
    lib = kernels()
    if lib is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    q = q.contiguous()
    slots, lengths = slots.contiguous(), lengths.contiguous()
    out = torch.empty_like(q)
    done = lib.kq_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                   lengths.data_ptr(), out.data_ptr(), batch, heads, k_cache.shape[1], dim,
                                   slots.shape[1], scale, torch.get_num_threads())
    return out if done else None  # not done: a head size or grouping the kernel does not take
