"""Rotary position embedding, computed from `inv_freq` in fp32.

Kept apart from the model because reuse methods rotate cached keys by a position
delta with the very same function: k' = k*cos + rotate_half(k)*sin.
"""

from __future__ import annotations

import math

import torch

from engine_ext.config import RopeConfig
from engine_ext.kernels.compiled import kernels


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies, shape (rotary_dim // 2,), fp32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # (rotary_dim/2,)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for integer (or integer-valued) positions, each (N, rotary_dim), fp32."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (N, rotary_dim/2)
    angles = torch.cat((angles, angles), dim=-1)  # (N, rotary_dim)
    return angles.cos(), angles.sin()


def _compiled_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """The rotation in one pass, or None where the kernel does not apply: x must be fp32
    with each token's heads contiguous (a view into a fused projection is fine)."""
    if (x.dtype != torch.float32 or cos.dtype != torch.float32 or torch.is_grad_enabled() or x.dim() != 3
            or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.shape[0] == 0):
        return None
    lib = kernels()
    if lib is None:
        return None
    rows, heads, dim = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(rows, heads, dim)
    lib.kq_rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), 0 if cos.shape[0] == 1 else cos.shape[1],
                  out.data_ptr(), rows, heads, dim, cos.shape[1], torch.get_num_threads())
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x (N, heads, head_dim) by per-token angles.

    cos/sin are (N, rotary_dim), or (1, rotary_dim) for one angle set for every token,
    in fp32; the rotation runs in fp32 and is cast back. fp32 inference runs on the
    compiled kernel where it loads (elementwise.cpp: bitwise this function's result).
    """
    compiled = _compiled_rotary(x, cos, sin)
    if compiled is not None:
        return compiled
    rotary_dim = cos.shape[-1]
    x32 = x.to(torch.float32)
    rot, rest = x32[..., :rotary_dim], x32[..., rotary_dim:]
    rot = rot * cos[:, None, :] + _rotate_half(rot) * sin[:, None, :]  # (N, heads, rotary_dim)
    out = torch.cat((rot, rest), dim=-1) if rest.numel() else rot
    return out.to(x.dtype)

