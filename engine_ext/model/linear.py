"""PackedLinear: nn.Linear whose product can run on a weight prepacked for oneDNN.

A decode step multiplies one row per sequence by every weight of the model, so its time
is the time the weights take to stream from memory, and which library streams them
faster depends on the CPU. Measured on 2-core machines, SmolLM2-135M's decode-shaped
products over all its weights (1 and 8 rows):
- AMD EPYC (AVX-512, no AMX), fp32: oneDNN on packed weights 26-27 ms, `F.linear`
  (MKL) 47 ms at 1 row and 62 ms at 8: packing nearly doubles decode (16 -> 27 tok/s
  at batch 1, 93 -> 189 at batch 8) and prefills 5-8% faster;
- Intel with AMX, fp32: packing was slower than MKL at 1 row; bf16: packed decodes
  10-17% faster.
So for fp32 the loader measures both on the model's own weights and keeps the faster
(`pack_linears(..., "auto")`); bf16 and fp16 are always packed where oneDNN exists,
since packed they give each row the same bits whatever the batch (what lets those
dtypes decode batched equal solo) and where the CPU has a oneDNN kernel for them (fp16
needs AVX512-FP16; without it fp16 stays on F.linear). The packed copy is made once, after loading; the
plain weight stays the parameter, for what reads it (adapter training, the vLLM bridge).

As with `F.linear`, a row's fp32 result can differ in its last bits with the number of
rows beside it (the kernel blocks the reduction by shape), so fp32 batched and solo
decoding agree to rounding, not bit for bit; the engine's batched-equals-solo tests
compare greedy tokens.

A layer may also hold a weight-only quantized copy (`quant`, set by
engine_ext/model/quantize.py): products of up to `QUANT_MAX_ROWS` rows (decode) then run on
it, and longer ones (prefill) on the dense weight, which holds the same values.
"""

from __future__ import annotations

import time
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from engine_ext.kernels.quant import QuantWeight
from kvrelay.engine_options import LinearKernel

# Decode batches the choice is timed at: one sequence, and a batch of agents.
_TIMED_ROWS = (1, 8)
# The batch-size hint that picks oneDNN's layout; 8 measured as fast as 1 at one row.
_PACK_HINT = 8
# Up to this many rows a product runs on the quantized weight, which streams 4-5x fewer
# bytes; beyond, the dense fp32 product is faster (it reuses each weight across rows).
QUANT_MAX_ROWS = 16


def onednn_available() -> bool:
    """Whether this torch build can prepack weights for oneDNN."""
    # torch leaves mkldnn.is_available unannotated.
    available: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return available and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU has a oneDNN kernel to pack `dtype` weights for: bf16 needs
    AVX512-BW/VL/DQ or AVX-NE-CONVERT, fp16 AVX512-FP16; an AVX2-only CPU packs fp32 only."""
    if not onednn_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), _PACK_HINT)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Linear):
    """nn.Linear, plus `pack()`: from then on the product reads a oneDNN-packed copy of
    the weight. Unpacked (before `pack`, after `unpack`, or where oneDNN is absent) it
    is nn.Linear. With `quant` set, products of few rows read that instead."""

    packed: torch.Tensor | None = None
    quant: QuantWeight | None = None

    def pack(self) -> None:
        """Prepack the current weight (call again after changing it)."""
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_HINT)

    def unpack(self) -> None:
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and x.dim() == 2 and x.shape[0] <= QUANT_MAX_ROWS \
                and x.dtype == torch.float32:
            y = self.quant.linear(x, torch.get_num_threads())
            return y if self.bias is None else y + self.bias
        return self.dense(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the dense weight (packed where packed)."""
        if self.packed is None or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        # torch.ops resolves its operators at run time: their results are typed Any.
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out


def pack_linears(model: nn.Module, kernel: LinearKernel = "auto") -> int:
    """Pack the PackedLinears of `model` when oneDNN is there and `kernel` (or, for
    "auto", the dtype or a timing on the model's own weights) says so; how many were packed."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if kernel == "plain" or not layers or not onednn_packs(layers[0].weight.dtype):
        return 0
    for layer in layers:
        layer.pack()
    if kernel == "auto" and layers[0].weight.dtype == torch.float32 and not _packed_is_faster(layers):
        for layer in layers:
            layer.unpack()
        return 0
    return len(layers)


def _packed_is_faster(layers: list[PackedLinear], rounds: int = 3) -> bool:
    """Time decode-shaped products over every layer, packed and plain in alternating
    rounds (the weights stream from memory as in a real step); compare the best rounds."""
    inputs = {(layer.in_features, rows): torch.randn(rows, layer.in_features, dtype=layer.weight.dtype)
              for layer in layers for rows in _TIMED_ROWS}
    packed = [layer.packed for layer in layers]

    def sweep(use_packed: bool) -> float:
        for layer, copy in zip(layers, packed):
            layer.packed = copy if use_packed else None
        start = time.perf_counter()
        with torch.inference_mode():
            for rows in _TIMED_ROWS:
                for layer in layers:
                    layer.dense(inputs[layer.in_features, rows])
        return time.perf_counter() - start

    best = {True: float("inf"), False: float("inf")}
    for round_ in range(rounds + 1):
        timings = {use: sweep(use) for use in (True, False)}
        if round_:  # the first round only warms both paths
            best = {use: min(best[use], timings[use]) for use in best}
    for layer, copy in zip(layers, packed):
        layer.packed = copy
    return best[True] <= best[False]
