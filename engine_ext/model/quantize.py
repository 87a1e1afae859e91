"""Which weights decode on a quantized copy (`--linear-kernel int4`, or `auto`).

The default model ships as a GGUF whose projections are Q4_1 and whose output matrix
(tied to the embeddings) is Q8_0; the engine dequantizes it to fp32 at install, and until
this module it streamed those 540 MB of fp32 per decoded token. Requantized per block of
32, the same weights come back exactly (every value checked), so decoding on the 4- and
8-bit copies (about 113 MB per token) changes no weight, only the order of the sums:

- `auto` quantizes when that holds for every layer, the model runs fp32 and this CPU has
  the kernel; otherwise it leaves the model as it was.
- `int4` quantizes any fp32 model (an approximation for one that was not stored so: its
  dense weights are replaced by the quantized values, so prefill and decode agree); where
  the CPU has no kernel, the engine multiplies by those values on its dense path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine_ext.kernels.compiled import kernels
from engine_ext.kernels.quant import BLOCK, Q4_1, Q8_0, QuantWeight
from engine_ext.model.linear import PackedLinear
from kvrelay.engine_options import LinearKernel

log = logging.getLogger(__name__)

# Each layer's format, by module name: GGUF Q4_1 files keep the output matrix in Q8_0.
_OUTPUT_LAYERS = ("lm_head",)


def format_for(name: str) -> type[QuantWeight]:
    return Q8_0 if name in _OUTPUT_LAYERS else Q4_1


@dataclass(frozen=True)
class Quantized:
    """What `quantize_linears` did: layers given a quantized copy, and whether every one
    stores the dense weight exactly (then the model's weights did not change)."""

    layers: int = 0
    lossless: bool = True
    kernel: bool = False
    bytes: int = 0


def _candidates(model: nn.Module) -> Iterator[tuple[str, PackedLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear) and module.in_features % BLOCK == 0:
            yield name, module


def quantize_linears(model: nn.Module, kernel: LinearKernel) -> Quantized:
    """Give the model's layers quantized copies where `kernel` says so (see module doc).
    Call after the model has its dtype and before `pack_linears` (a lossy int4 changes the
    dense weights that packing copies)."""
    if kernel not in ("auto", "int4"):
        return Quantized()
    layers = list(_candidates(model))
    if not layers or layers[0][1].weight.dtype != torch.float32:
        return Quantized()
    has_kernel = kernels() is not None  # none without AVX-512F or AVX2+FMA, or if the build failed
    if kernel == "auto" and not has_kernel:
        return Quantized()
    quants = [(layer, format_for(name).quantize(layer.weight)) for name, layer in layers]
    lossless = all(quant.lossless(layer.weight) for layer, quant in quants)
    if kernel == "auto" and not lossless:
        return Quantized()
    with torch.no_grad():
        for layer, quant in quants:
            if not lossless:
                layer.weight.copy_(quant.dequantize())  # in place: a tied embedding follows
            if has_kernel:
                layer.quant = quant
    if not has_kernel:
        log.warning("int4: no quantized-product kernel here; decoding on the dequantized weights")
    return Quantized(len(quants), lossless, has_kernel, sum(quant.nbytes for _, quant in quants))
