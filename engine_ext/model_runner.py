"""Turns a scheduled step into model inputs, runs the model, samples next tokens."""

from __future__ import annotations

import torch

from engine_ext.kv.cache import KVCache
from engine_ext.kv.manager import KVCacheManager
from engine_ext.model import AttentionMetadata, CausalLM
from engine_ext.sampling import Sampler
from engine_ext.scheduler import SchedulerOutput
from engine_ext.sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, kv: KVCacheManager, sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv
        self.sampler = sampler

    def run(self, step: SchedulerOutput) -> list[tuple[Sequence, int]]:
        """Compute the scheduled tokens; sample for each sequence whose chunk reaches its end."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        new_slots: list[torch.Tensor] = []
        prefill_chunks: list[tuple[int, torch.Tensor]] = []
        decode_contexts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        for seq, num_tokens in step.chunks:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
            context = self.kv.slots(seq, end)  # (end,)
            input_ids += seq.token_ids[start:end]
            positions.append(torch.arange(start, end))
            new_slots.append(context[start:])
            if num_tokens == 1:
                decode_contexts.append(context)
            else:
                prefill_chunks.append((num_tokens, context))
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
        meta = AttentionMetadata.build(torch.cat(new_slots), prefill_chunks, decode_contexts)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long), torch.cat(positions), self.kv_cache.layers, meta
        )  # (N, hidden)
        if not sampling_seqs:
            return []
        logits = self.model.compute_logits(hidden[sample_rows])  # (num_sampling, vocab)
        tokens = self.sampler.sample(
            logits, [s.sampling for s in sampling_seqs], [s.generator for s in sampling_seqs]
        )
        return list(zip(sampling_seqs, tokens))
