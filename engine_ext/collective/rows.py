"""RowsForward: one batched forward over chosen positions of many prompts at once.

Collective reuse computes, for every request of a round, only some positions of its
prompt (the ones no placed segment covers, plus those chosen for recomputation), each
attending to every key at or before it, placed or fresh. Running the requests one by
one repeats each layer's launch and its small matmuls per request; here the rows of all
requests go through each layer as one flat batch (one qkv and one MLP matmul per layer
for the whole round), and only attention is split per request, one span each.

On the check layers the keys of watched rows are compared with what was there before
the layer wrote them (the placed KV): the L2 deviation CacheBlend selects by.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.kv.cache import KVCache
from engine_ext.model import AttentionMetadata, CausalLM
from engine_ext.model.attention import PrefillSpan
from engine_ext.kernels.rope import rope_cos_sin


class PromptRows(NamedTuple):
    """One prompt's positions to compute."""

    token_ids: list[int]
    slots: torch.Tensor  # (T,) the prompt's cache slots
    rows: torch.Tensor  # (R,) sorted positions; the last one is the prompt's last token
    watched: torch.Tensor  # (R,) bool: rows whose key deviation is measured on the check layers


class RowsResult(NamedTuple):
    last_hidden: list[torch.Tensor]  # per prompt, (1, hidden): normed state of its last row
    deviation: list[torch.Tensor]  # per prompt, (W,): key deviation of its watched rows, summed over check layers


class RowsForward:
    def __init__(self, model: CausalLM, kv_cache: KVCache, check_layers: tuple[int, ...]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.check_layers = frozenset(check_layers)

    @torch.inference_mode()
    def run(self, prompts: list[PromptRows], num_layers: int | None = None) -> RowsResult:
        """Compute the rows of every prompt through the first `num_layers` layers (all
        by default), writing their K/V into the prompts' slots."""
        num_layers = len(self.model.layers) if num_layers is None else num_layers
        rows = torch.cat([p.rows for p in prompts])  # (N,) positions, flat over prompts
        tokens = torch.cat([torch.tensor(p.token_ids, dtype=torch.long)[p.rows] for p in prompts])  # (N,)
        watched = torch.cat([p.watched for p in prompts])  # (N,)
        new_slots = torch.cat([p.slots[p.rows] for p in prompts])  # (N,)
        watched_slots = new_slots[watched]  # (W_total,)
        meta = _metadata(prompts, new_slots)
        cos, sin = rope_cos_sin(self.model.inv_freq, rows)  # each (N, rotary_dim)
        x = self.model.embed_tokens(tokens)  # (N, hidden)
        deviation = torch.zeros(watched_slots.shape[0])  # (W_total,)
        layers = zip(self.model.layers[:num_layers], self.kv_cache.layers[:num_layers])
        for layer_idx, (layer, cache) in enumerate(layers):
            checking = layer_idx in self.check_layers and watched_slots.numel() > 0
            placed = cache[0].index_select(0, watched_slots).float() if checking else None  # (W, kv_heads, D)
            x = layer(x, cos, sin, cache, meta)
            if placed is not None:
                fresh = cache[0].index_select(0, watched_slots).float()
                deviation += (fresh - placed).pow(2).sum(dim=(-2, -1)).sqrt()
        ends = torch.tensor([p.rows.shape[0] for p in prompts]).cumsum(0)  # (B,)
        last = self.model.norm(x[ends - 1])  # (B, hidden)
        counts = [int(p.watched.sum()) for p in prompts]
        return RowsResult([last[i : i + 1] for i in range(len(prompts))], list(torch.split(deviation, counts)))


def _metadata(prompts: list[PromptRows], new_slots: torch.Tensor) -> AttentionMetadata:
    """One prefill span per prompt: its query at position rows[i] sees every key of
    its own prompt at a position <= rows[i] (placed, cached, or written this layer)."""
    spans, start = [], 0
    for p in prompts:
        context = p.slots[: len(p.token_ids)]  # (T,)
        spans.append(PrefillSpan(start=start, num_tokens=p.rows.shape[0], context_slots=context, positions=p.rows))
        start += p.rows.shape[0]
    return AttentionMetadata(new_slots, spans, start, None, None)
