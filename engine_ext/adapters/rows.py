"""AdapterRows: which rows of a flat model batch run through which adapter.

The model's projections compute the base output for every row, then each adapted span
of rows adds its adapter's low-rank update (multi-LoRA: one base matmul for the whole
batch, one small matmul pair per adapter span). Rows outside every span are the base.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.adapters.lora import LoraAdapter


class AdapterSpan(NamedTuple):
    start: int
    end: int  # rows [start, end) of the flat batch
    adapter: LoraAdapter


class AdapterRows:
    def __init__(self, spans: list[AdapterSpan]) -> None:
        self.spans = [span for span in spans if span.end > span.start]

    def add(self, out: torch.Tensor, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        """`out` (N, out_features) with each span's update for `projection` added in place."""
        for start, end, adapter in self.spans:
            delta = adapter.delta(layer, projection, x[start:end])  # (rows, out_features) or None
            if delta is not None:
                out[start:end] += delta.to(out.dtype)
        return out
