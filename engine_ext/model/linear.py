"""PackedLinear: nn.Linear whose product runs on a weight prepacked for oneDNN.

A decode step multiplies one row per sequence by every weight of the model, so its
time is the time the weights take to stream from memory. For bf16 weights, oneDNN on a
copy of the weight reordered once into its blocked layout (AMX tiles where the CPU has
them) streams them faster than `F.linear`: on a 2-core AVX-512 machine, SmolLM2-135M
decodes 10% faster at batch 1 and 17% at batch 8, and prefills 5-14% faster. For fp32
the same packing is slower than `F.linear` (MKL) at batch 1, so the loader packs bf16
models only (loader.py). The copy is made once, after the weights are loaded (`pack`);
the plain weight stays the parameter, for what reads it (adapter training, the vLLM
bridge).

As with `F.linear`, a row's fp32 result can differ in its last bits with the number of
rows beside it (the kernel blocks the reduction by shape), so batched and solo decoding
agree to rounding, not bit for bit; the engine's batched-equals-solo tests compare
greedy tokens, as before. In bf16 both give each row the same bits whatever the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_available() -> bool:
    """Whether this torch build can prepack weights for oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Linear):
    """nn.Linear, plus `pack()`: from then on the product reads a oneDNN-packed copy of
    the weight. Unpacked (before `pack`, or where oneDNN is absent) it is nn.Linear."""

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Prepack the current weight (call again after changing it)."""
        with torch.no_grad():
            # The batch-size hint picks the layout; 1 is the decode step's shape.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Pack every PackedLinear of `model` when oneDNN is there; how many were packed."""
    if not onednn_available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for layer in layers:
        layer.pack()
    return len(layers)
