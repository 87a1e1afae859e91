"""Compute kernels: torch reference implementations (Triton versions plug in beside them)."""

from __future__ import annotations

import functools

from engine_ext.kernels.diff_restore import restore_mirror, restore_mirror_dense
from engine_ext.kernels.rope import apply_rotary, rope_cos_sin, rope_inv_freq
from engine_ext.kernels.shift_copy import shift_copy

__all__ = [
    "apply_rotary",
    "restore_mirror",
    "restore_mirror_dense",
    "rope_cos_sin",
    "rope_inv_freq",
    "shift_copy",
    "triton_available",
]


@functools.cache
def triton_available() -> bool:
    """Whether `import triton` works. Triton is an optional extra (kvrelay[triton]), so the
    dispatchers ask this before importing a Triton module; the answer is cached because
    importing triton takes a while and cannot change within a process. Only ImportError
    means "not installed": any other failure of a present install is left to surface."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
