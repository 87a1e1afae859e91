"""Moving cached keys to new positions: the RoPE shift every non-prefix reuse builds on.

A key rotated for position p becomes the key for position p + delta by one more
rotation of angle delta * theta_i (rotations compose), so no pre-RoPE copy is needed:
k' = k * cos(delta * theta) + rotate_half(k) * sin(delta * theta). Values carry no
position and are never touched.

This is exact only when a position's rotation depends on nothing but the position:
plain RoPE and the llama3 / linear scalings, which change `inv_freq` alone. Dynamic
NTK, YaRN and LongRoPE rescale with the sequence length, so a shifted key would not
match a recomputed one; `RopeShifter.for_rope_type` refuses them.
"""

from __future__ import annotations

import torch

from engine_ext.config import ModelConfig
from engine_ext.errors import EngineError
from engine_ext.kernels.rope import apply_rotary, rope_cos_sin, rope_inv_freq
from engine_ext.kernels.rope_shift import shift_keys

EXACT_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


class RopeShiftError(EngineError):
    """The model's position encoding cannot be shifted exactly."""


class RopeShifter:
    """Shifts post-RoPE keys of one model by position deltas, in fp32."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.to(torch.float32)  # (rotary_dim/2,)

    @classmethod
    def for_model(cls, cfg: ModelConfig) -> RopeShifter:
        cls.for_rope_type(cfg.rope.rope_type)
        return cls(rope_inv_freq(cfg.rope, cfg.rotary_dim))

    @staticmethod
    def for_rope_type(rope_type: str) -> None:
        """Raise RopeShiftError unless keys under this rope type shift exactly."""
        if rope_type not in EXACT_ROPE_TYPES:
            raise RopeShiftError(
                f"rope scaling {rope_type!r} depends on the sequence length, so cached keys "
                f"cannot be moved to new positions exactly (supported: {', '.join(sorted(EXACT_ROPE_TYPES))})"
            )

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def shift(self, keys: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """keys (n, kv_heads, head_dim) post-RoPE; delta an int or (n,) ints.
        Returns the keys as if computed `delta` positions later, same dtype.

        One delta for every key (a segment moved as a whole, every layer of it) is one
        angle per frequency: cos and sin are computed once, (1, rotary_dim), and broadcast,
        the same values per token as the per-key path computes n times over."""
        if isinstance(delta, int):
            if delta == 0:
                return keys
            if not keys.is_cuda:
                one = torch.tensor([delta], dtype=torch.long)
                cos, sin = rope_cos_sin(self.inv_freq, one)  # each (1, rotary_dim)
                return apply_rotary(keys, cos, sin)
            delta = torch.full((keys.shape[0],), delta, dtype=torch.long, device=keys.device)
        return shift_keys(keys, delta, self.inv_freq.to(keys.device))
