"""Block-sparse diff restore of a mirror KV cache: the torch references (used on CPU),
the dense baseline, and the dispatch to the fused Triton kernel on CUDA devices when
triton is installed.

TokenDance's Master-Mirror storage keeps one master KV cache per shared context and each
mirror (a request's variant of it) as a diff: the mirror's tokens are laid out in blocks of
`block_tokens` that follow the prompt's structure (each segment and each stretch of text
between segments starts a new block, so a block's unused tail is padding); an untouched
block is the master's aligned tokens moved to the mirror's positions (a RoPE shift by a
per-token delta), a touched block is stored verbatim, already at the mirror's positions.
Restoring a mirror writes its real tokens into the slots `dst`.

The dense restore (`restore_mirror_dense`) first materialises the whole mirror (its real
tokens) in fresh (r, kv_heads, head_dim) tensors, rotating every aligned master row and
then overwriting the touched blocks, and copies the result in: the obvious way, and the
baseline. The fused restore decides per block, once, between skipping the rotation
(verbatim copy) and correcting the master row (gather and rotate), and writes each
destination row once.

Layout, shared by every function here: k_cache, v_cache (num_slots, kv_heads, head_dim);
dst, base_src, delta (n,) int64, token i in block b = i // block_tokens at offset
k = i - b * block_tokens; dst[i] == -1 marks padding, which is skipped entirely (nothing
read, nothing written; its base_src is -1 and its delta 0). Padding only ever follows a
block's real tokens; the caller's n is a multiple of block_tokens, but a short last block
is supported. block_diff (ceil(n / block_tokens),) int64, -1 for an untouched block, else
the offset in diff_slots of the block's first stored token: its real token k is in slot
diff_slots[block_diff[b] + k]. The diff stores real tokens only, so consecutive touched
blocks' offsets differ by their number of real tokens, not by block_tokens. inv_freq
(rotary_dim/2,) fp32. base_src of tokens in touched blocks may be -1: the fused restores
never read their base_src or delta, the dense one rotates those >= 0 and then overwrites
them. dst entries other than -1 must be distinct and disjoint from every slot read.
"""

from __future__ import annotations

import torch

from engine_ext.kernels.rope_shift import shift_keys, shift_keys_torch
from engine_ext.kernels.shift_copy import check_caches


def check_restore_args(
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
    """Shape and device checks shared by the references and the Triton wrapper. Slot,
    offset and padding values are not checked: on CUDA that would cost a host sync per
    call."""
    check_caches(k_cache, v_cache, inv_freq)
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if dst.dim() != 1:
        raise ValueError(f"dst must be (n,), got shape {tuple(dst.shape)}")
    n = dst.shape[0]
    for name, t in (("base_src", base_src), ("delta", delta)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) like dst, got {tuple(t.shape)}")
    num_blocks = -(-n // block_tokens)
    if block_diff.shape != (num_blocks,):
        raise ValueError(
            f"block_diff must have shape ({num_blocks},) (ceil({n} / {block_tokens})), got {tuple(block_diff.shape)}"
        )
    if diff_slots.dim() != 1:
        raise ValueError(f"diff_slots must be 1-D, got shape {tuple(diff_slots.shape)}")
    if any(t.device != k_cache.device for t in (dst, base_src, delta, block_diff, diff_slots)):
        raise ValueError("dst, base_src, delta, block_diff and diff_slots must be on the caches' device")


def _diff_sources(
    block_diff: torch.Tensor, diff_slots: torch.Tensor, real: torch.Tensor, block_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, whether it is a real token of a touched block (n,) bool and its stored
    slot (n,), -1 elsewhere; no per-block loop: token i of block b = i // block_tokens
    reads diff_slots[block_diff[b] + i % block_tokens]. real (n,) bool: not padding."""
    token = torch.arange(real.shape[0], device=block_diff.device)  # (n,)
    offset = block_diff[token // block_tokens].to(torch.int64)  # (n,): -1 or the block's first stored token
    touched = (offset >= 0) & real
    diff_src = torch.full_like(offset, -1)
    # Gathered for real touched tokens only: an untouched block's -1 would point before
    # diff_slots, and a touched block's padding past its stored tokens (or diff_slots' end).
    diff_src[touched] = diff_slots[offset[touched] + token[touched] % block_tokens]
    return touched, diff_src


def restore_mirror_torch(
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
    """Fused restore, in place: per real token, the merged source slot (its diff row if
    its block is touched, else its master row), then one rotation of the untouched
    tokens' keys only; touched rows are copied verbatim, bit for bit, padding is skipped.
    All sources are read before any destination is written."""
    check_restore_args(k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots, block_tokens, inv_freq)
    real = dst >= 0  # (n,): padding (-1) is neither read nor written
    touched, diff_src = _diff_sources(block_diff, diff_slots, real, block_tokens)
    merged = torch.where(touched, diff_src, base_src)  # (n,): -1 only at padding, never gathered
    rows = real.nonzero().squeeze(1)  # (r,) real token indices
    untouched = (real & ~touched).nonzero().squeeze(1)  # (r - m,) token indices
    verbatim = touched.nonzero().squeeze(1)  # (m,) token indices

    keys = shift_keys_torch(k_cache.index_select(0, merged[untouched]), delta[untouched], inv_freq)
    copied = k_cache.index_select(0, merged[verbatim])  # (m, kv_heads, D)
    values = v_cache.index_select(0, merged[rows])  # (r, kv_heads, D), never rotated
    k_cache.index_copy_(0, dst[untouched], keys)
    k_cache.index_copy_(0, dst[verbatim], copied)
    v_cache.index_copy_(0, dst[rows], values)


def restore_mirror_dense(
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
    """Dense restore, in place: the whole mirror (its r real tokens) in temporaries, then
    one copy into dst.

    Every aligned master row (base_src >= 0) is gathered and rotated, touched blocks'
    included, then the touched blocks are overwritten from the diff: the work the fused
    restore skips. The rotation is `shift_keys` (Triton on CUDA), so on GPUs the baseline
    is not slowed by the torch rotation; on CPU the result equals restore_mirror_torch's.
    """
    check_restore_args(k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots, block_tokens, inv_freq)
    real = dst >= 0  # (n,): padding (-1) is neither read nor written
    rows = real.nonzero().squeeze(1)  # (r,) real token indices
    k_mirror = k_cache.new_empty((rows.shape[0], *k_cache.shape[1:]))  # (r, kv_heads, D)
    v_mirror = v_cache.new_empty((rows.shape[0], *v_cache.shape[1:]))  # (r, kv_heads, D)
    base = base_src[rows]  # (r,)
    aligned = (base >= 0).nonzero().squeeze(1)  # mirror rows with a master row
    master = base[aligned]
    k_mirror[aligned] = shift_keys(k_cache.index_select(0, master), delta[rows[aligned]], inv_freq)
    v_mirror[aligned] = v_cache.index_select(0, master)
    touched, diff_src = _diff_sources(block_diff, diff_slots, real, block_tokens)  # each (n,)
    verbatim = touched[rows].nonzero().squeeze(1)  # (m,) mirror rows
    stored = diff_src[rows[verbatim]]  # (m,)
    k_mirror[verbatim] = k_cache.index_select(0, stored)
    v_mirror[verbatim] = v_cache.index_select(0, stored)
    k_cache.index_copy_(0, dst[rows], k_mirror)
    v_cache.index_copy_(0, dst[rows], v_mirror)


def restore_mirror(
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
    """Fused mirror restore: the Triton kernel on CUDA, the torch reference elsewhere."""
    args = (k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots, block_tokens, inv_freq)
    if k_cache.is_cuda:
        from engine_ext.kernels import triton_available

        if triton_available():
            from engine_ext.kernels.diff_restore_triton import restore_mirror_triton

            restore_mirror_triton(*args)
            return
    restore_mirror_torch(*args)
