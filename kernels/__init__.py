"""Compute kernels: torch reference implementations (Triton versions plug in beside them)."""

from __future__ import annotations

from kernels.rope import apply_rotary, rope_cos_sin, rope_inv_freq

__all__ = ["apply_rotary", "rope_cos_sin", "rope_inv_freq"]
