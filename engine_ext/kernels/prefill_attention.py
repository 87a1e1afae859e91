"""Causal attention of prefill queries on the compiled kernel
(engine_ext/kernels/prefill_attention.cpp).

Each query sees the keys of its context up to its own position. A prefill chunk's T
queries are the last T positions of its L-token context (query t sees up to L - T + t):
the same rule for a whole prompt, a later chunk of a long one, and the new tail after a
prefix hit. A reuse method's recomputed rows sit at any positions. The kernel applies the
rule from the positions, with no (T, L) mask, and skips the key blocks no query of a
block can see. A query row's result depends only on its own query and the keys it sees,
so chunking and prefix hits give bitwise the rows a single pass gives.

Used for fp32 without autograd where the library loads and the head size is a multiple
of 16 (up to 256); otherwise `prefill_attention` returns None and the caller runs
torch's SDPA.
"""

from __future__ import annotations

import torch

from engine_ext.kernels.compiled import kernels

KEY_BLOCK = 128  # the kernel's keys per block: the transposed keys are padded to it
MAX_DIM = 256


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      positions: torch.Tensor | None = None) -> torch.Tensor | None:
    """q (T, H, D); k, v (L, KVH, D), the context in position order; positions (T,) int64,
    the last key each query sees (default: the last T positions, L >= T). Returns
    (T, H, D), or None where the kernel does not apply."""
    tokens, heads, dim = q.shape
    length, kv_heads = k.shape[0], k.shape[1]
    if (any(t.dtype != torch.float32 for t in (q, k, v)) or torch.is_grad_enabled() or dim % 16
            or dim > MAX_DIM or heads % kv_heads or tokens > length and positions is None):
        return None
    if positions is None:
        positions = torch.arange(length - tokens, length)
    positions = positions.to(torch.int64).contiguous()
    lib = kernels()
    if lib is None:
        return None
    padded = -(-length // KEY_BLOCK) * KEY_BLOCK
    # (KVH, Lp / KEY_BLOCK, D, KEY_BLOCK): each block of keys transposed and contiguous, in one
    # copy (splitting the first dimension is a view whatever k's strides); padding stays 0
    k_t = k.new_zeros(kv_heads, padded // KEY_BLOCK, dim, KEY_BLOCK)
    full = length // KEY_BLOCK
    k_t[:, :full] = k[: full * KEY_BLOCK].reshape(full, KEY_BLOCK, kv_heads, dim).permute(2, 0, 3, 1)
    if full * KEY_BLOCK < length:
        k_t[:, full, :, : length - full * KEY_BLOCK] = k[full * KEY_BLOCK :].permute(1, 2, 0)  # (KVH, D, rest)
    v_h = v.transpose(0, 1).contiguous()  # (KVH, L, D)
    if q.stride(2) != 1 or q.stride(1) != dim:
        q = q.contiguous()
    out = q.new_empty(tokens, heads, dim)  # (T, H, D)
    done = lib.kq_prefill_attention(q.data_ptr(), q.stride(0), k_t.data_ptr(), v_h.data_ptr(), positions.data_ptr(),
                                    out.data_ptr(), tokens, length, padded, heads, kv_heads, dim, scale,
                                    torch.get_num_threads())
    return out if done else None  # not done: a position outside [0, L)
