"""ModelBridge: the worker-side computation of placed segments inside vLLM.

vLLM computes a prompt from its first uncached token to its end; it cannot compute the
text around a segment whose KV came from elsewhere. So, as LMCache does for CacheBlend,
the connector claims the prompt up to the end of its last placed segment as its own
(vLLM sees those tokens as loaded), and the worker fills them before vLLM reads them:

1. the leading tokens vLLM already holds are read from the request's blocks;
2. each placed segment's stored KV goes in at its new position, keys RoPE-shifted by
   the distance it moved (values carry no position);
3. kvrelay's own model computes every other claimed token (the text between segments),
   each attending to everything before it; with blend, the segments' tokens are also
   computed up to the check layer and the `blend_ratio` of them whose keys deviate most
   stay computed in the deeper layers (CacheBlend);
4. the result is written into the request's blocks; vLLM computes the rest.

The model is kvrelay's Llama-family implementation with the same checkpoint vLLM serves
(its own copy of the weights), so before any of its KV is mixed into vLLM's, the layout
of vLLM's cache and the two implementations are checked against each other on layer 0
(`check_layout`); a mismatch turns placement off for the process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_ext.config import ModelConfig
from engine_ext.model import AttentionMetadata, CausalLM
from engine_ext.model.attention import PrefillSpan
from engine_ext.model.loader import load_model
from engine_ext.rope import RopeShifter
from engine_ext.vllm.paged import PagedKV
from engine_ext.vllm.segment_plan import ReuseJob
from engine_ext.kernels.rope import rope_cos_sin

LAYOUT_TOLERANCE = 1e-3  # layer-0 K/V of two fp32 implementations agree to ~1e-5


class LayoutMismatch(RuntimeError):
    """vLLM's cache does not hold what this bridge would read or write."""


@dataclass(frozen=True)
class SegmentKV:
    """A stored segment: K and V of every layer, (L, n, kv_heads, head_dim) each, computed at `position`."""

    keys: torch.Tensor
    values: torch.Tensor
    position: int


class ModelBridge:
    def __init__(self, model: CausalLM, paged: PagedKV) -> None:
        self.model = model
        self.paged = paged
        self.shifter = RopeShifter.for_model(model.config)
        self.checked = False

    @classmethod
    def load(cls, model_dir: Path, paged: PagedKV) -> ModelBridge:
        cfg = ModelConfig.from_dir(model_dir)
        return cls(load_model(model_dir, cfg, "float32"), paged)

    def check_layout(self, token_ids: list[int], block_ids: list[int]) -> None:
        """Raise LayoutMismatch unless layer 0's K/V of these (computed, leading) tokens,
        read from vLLM's blocks, equal this model's own."""
        k, v = self.paged.read(0, block_ids, 0, len(token_ids))
        self.check_layer0(token_ids, 0, k, v)

    @torch.inference_mode()
    def check_layer0(self, token_ids: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise LayoutMismatch unless vLLM's layer-0 K and V of tokens at positions
        [start, start + n), as read through PagedKV, equal this model's own. Layer 0
        depends on nothing but each token and its position, so any span vLLM computed
        will do."""
        n = len(token_ids)
        positions = torch.arange(start, start + n)
        cos, sin = rope_cos_sin(self.model.inv_freq, positions)
        cache = _scratch(self.model.config, start + n)
        self.model.layers[0](self.model.embed_tokens(torch.tensor(list(token_ids))), cos, sin, cache[0],
                             _metadata(positions, start + n))
        error = max((k.float() - cache[0][0][start:]).abs().max().item(),
                    (v.float() - cache[0][1][start:]).abs().max().item())
        if error > LAYOUT_TOLERANCE:
            raise LayoutMismatch(f"layer 0 of vLLM's cache differs from kvrelay's model by {error:.3g} "
                                 f"(layout {self.paged.layout}); placing segments is off")
        self.checked = True

    @torch.inference_mode()
    def run(self, job: ReuseJob, segments: list[SegmentKV]) -> None:
        """Fill positions [job.num_computed, job.end) of the request's blocks (see the module docstring)."""
        cfg = self.model.config
        cache = _scratch(cfg, job.end)
        for layer in range(cfg.num_layers):  # 1. what vLLM holds
            if job.num_computed:
                k, v = self.paged.read(layer, job.block_ids, 0, job.num_computed)
                cache[layer][0][: job.num_computed] = k
                cache[layer][1][: job.num_computed] = v
        computed = torch.zeros(job.end, dtype=torch.bool)
        computed[job.num_computed :] = True
        candidates: list[torch.Tensor] = []
        for span, seg in zip(job.spans, segments, strict=True):  # 2. the placed segments
            delta = span.start - (seg.position + span.skip)
            for layer in range(cfg.num_layers):
                cache[layer][0][span.start : span.end] = self.shifter.shift(seg.keys[layer, span.skip :], delta)
                cache[layer][1][span.start : span.end] = seg.values[layer, span.skip :]
            computed[span.start : span.end] = False
            if job.blend_ratio > 0:
                candidates.append(torch.arange(span.start, span.end))
        self._compute(job, cache, computed.nonzero().flatten(), candidates)  # 3.
        for layer in range(cfg.num_layers):  # 4.
            self.paged.write(layer, job.block_ids, job.num_computed, cache[layer][0][job.num_computed :],
                             cache[layer][1][job.num_computed :])

    def _compute(self, job: ReuseJob, cache: list[tuple[torch.Tensor, torch.Tensor]], full: torch.Tensor,
                 candidates: list[torch.Tensor]) -> None:
        """Run the model over rows `full` (every layer) and blend candidates (up to the check layer)."""
        cand = torch.cat(candidates) if candidates else torch.empty(0, dtype=torch.long)  # (C,)
        rows, _ = torch.sort(torch.cat((full, cand)))  # (R + C,)
        if rows.numel() == 0:
            return
        is_candidate = torch.isin(rows, cand)
        deviation = torch.zeros(int(is_candidate.sum()))  # (C,)
        tokens = torch.tensor(job.token_ids, dtype=torch.long)
        x = self.model.embed_tokens(tokens[rows])  # (R + C, hidden)
        cos, sin = rope_cos_sin(self.model.inv_freq, rows)
        meta = _metadata(rows, job.end)
        for layer_idx, layer in enumerate(self.model.layers):
            checking = cand.numel() > 0 and layer_idx == job.check_layer
            placed_keys = cache[layer_idx][0][rows[is_candidate]].clone() if checking else None  # (C, H, D)
            x = layer(x, cos, sin, cache[layer_idx], meta)
            if placed_keys is not None:
                fresh = cache[layer_idx][0][rows[is_candidate]]
                deviation += (fresh - placed_keys).pow(2).sum(dim=(-2, -1)).sqrt()
                keep = _top_per_span(deviation, candidates, job.blend_ratio)
                kept = ~is_candidate
                kept[is_candidate] = keep
                rows, x = rows[kept], x[kept]
                cand = torch.empty(0, dtype=torch.long)
                is_candidate = torch.zeros_like(rows, dtype=torch.bool)
                cos, sin = rope_cos_sin(self.model.inv_freq, rows)
                meta = _metadata(rows, job.end)
            if rows.numel() == 0:
                return


def _top_per_span(deviation: torch.Tensor, spans: list[torch.Tensor], ratio: float) -> torch.Tensor:
    """Per span (not globally), keep the `ratio` of its tokens whose keys deviate most."""
    keep = torch.zeros_like(deviation, dtype=torch.bool)
    offset = 0
    for positions in spans:
        n = positions.numel()
        num_keep = min(n, math.ceil(ratio * n))
        if num_keep:
            keep[offset + deviation[offset : offset + n].topk(num_keep).indices] = True
        offset += n
    return keep


def _scratch(cfg: ModelConfig, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_tokens, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]


def _metadata(rows: torch.Tensor, num_context: int) -> AttentionMetadata:
    """Queries at positions `rows`, slots = positions; each sees every key at or before it."""
    return AttentionMetadata(rows, [PrefillSpan(0, rows.shape[0], torch.arange(num_context), rows)], rows.shape[0],
                             None, None)
