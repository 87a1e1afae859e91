"""Turns a scheduled step into model inputs, runs the model, samples next tokens.

The runner computes and reports; it calls nothing above it. What reuse does once
placed KV is computed (keep a round's caches, let go of what the prefill read) is the
engine's to ask of the ReuseLifecycle, from the `StepRun` the runner returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine_ext.adapters.lora import LoraAdapter
from engine_ext.adapters.rows import AdapterRows, AdapterSpan
from engine_ext.collective.collector import CollectiveGroup
from engine_ext.collective.prefill import CollectivePrefill, CollectiveResult, GroupMember
from engine_ext.kv.cache import KVCache
from engine_ext.kv.manager import KVCacheManager
from engine_ext.model import AttentionMetadata, CausalLM
from engine_ext.reuse.assembler import Assembly
from engine_ext.reuse.prefill import ReusePrefill
from engine_ext.sampling import Sampler
from engine_ext.scheduler import ScheduledChunk, SchedulerOutput
from engine_ext.sequence import Sequence


class DecoderRow(NamedTuple):
    """An ICaRus decoder query: the sequence's last token again, through base + adapter."""

    lora: LoraAdapter
    sample_index: int  # which sampled row it replaces
    decode: bool  # its sequence's chunk is a decode entry, else a prefill span
    source: int  # the decode entry whose keys it reads, or the prefill span at whose last position it sits
    token: int
    position: int


class RoundComputed(NamedTuple):
    """A round group's collective prefill, as the lifecycle keeps it."""

    seqs: list[Sequence]
    members: list[GroupMember]
    result: CollectiveResult


class StepRun(NamedTuple):
    sampled: list[tuple[Sequence, int]]  # each sequence whose chunk reached its end, and its next token
    rounds: list[RoundComputed]  # the step's collective prefills


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, kv: KVCacheManager, sampler: Sampler,
                 reuse: ReusePrefill | None = None, collective: CollectivePrefill | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv
        self.sampler = sampler
        self.reuse = reuse
        self.collective = collective
        # When the last run's forward passes ended and its sampling began (monotonic): the
        # engine's timelines split a request's prefill from its first token there.
        self.last_forward_end = 0.0

    def run(self, step: SchedulerOutput, interrupt: Callable[[], bool] | None = None) -> StepRun:
        """Compute the scheduled tokens; sample for each sequence whose chunk reaches its end.
        A round group's prefills run together, other prefills around placed segments one
        by one; everything else runs as one batch. A background step stops between layers
        once `interrupt` says so (StepInterrupted; nothing is sampled or kept)."""
        rows: list[tuple[Sequence, torch.Tensor]] = []  # (sequence, final hidden state (1, hidden))
        batch: list[ScheduledChunk] = []
        groups: dict[int, CollectiveGroup] = {}
        rounds: list[RoundComputed] = []
        for chunk in step.chunks:
            seq = chunk.seq
            if seq.group is not None:
                groups[id(seq.group)] = seq.group
            elif (assembly := seq.placement) is not None:
                rows.append((seq, self._run_reuse(seq, assembly)))
            else:
                batch.append(chunk)
        for group in groups.values():
            computed = self._run_group(group)
            rounds.append(computed)
            rows += zip(computed.seqs, computed.result.last_hidden)
        rows = self._decode_first_tokens(rows)
        scored: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        if batch:
            rows += self._run_batch(batch, scored, interrupt if step.background else None)
        self.last_forward_end = time.monotonic()
        for kept_logits, hidden in scored:  # positions before its last: their logits precede a sampled row's
            for row in self.model.compute_logits(hidden):
                kept_logits.append(row)
        if not rows:
            return StepRun([], rounds)
        seqs = [seq for seq, _ in rows]
        logits = self.model.compute_logits(torch.cat([h for _, h in rows]))  # (num_sampling, vocab)
        tokens = self.sampler.sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        for i, seq in enumerate(seqs):
            if seq.logits is not None:
                seq.logits.append(logits[i].clone())
            if seq.forced_token_ids is not None:
                tokens[i] = seq.forced_token_ids[len(seq.output_token_ids)]
        return StepRun(list(zip(seqs, tokens)), rounds)

    def compute(self, seq: Sequence, num_tokens: int) -> None:
        """Write the KV of the sequence's next `num_tokens` tokens (slots allocated), and
        sample nothing: an answer cut by length has its last token's KV computed so the
        answer can be kept whole."""
        self._run_batch([ScheduledChunk(seq, num_tokens)])

    def _run_reuse(self, seq: Sequence, assembly: Assembly) -> torch.Tensor:
        # Segments are placed only from the segment index, which comes with its prefill (reuse/parts.py).
        assert self.reuse is not None, "placed segments without a reuse prefill"
        slots = self.kv.slots(seq, seq.num_tokens)  # (T,)
        return self.reuse.run(assembly, seq.token_ids, slots, seq.timeline)

    def _run_group(self, group: CollectiveGroup) -> RoundComputed:
        """One collective prefill for the round's members."""
        seqs = group.members
        members = [self._member(s) for s in seqs]
        # Groups are formed only by the collector, which comes with the collective prefill (reuse/parts.py).
        assert self.collective is not None, "a round group without a collective prefill"
        return RoundComputed(seqs, members, self.collective.run(group.round_id, members))

    def _member(self, seq: Sequence) -> GroupMember:
        """A round group member's inputs to the collective prefill."""
        # The collector groups only sequences whose assembly places segments (collective/collector.py).
        assert seq.assembly is not None, "a round group member without an assembly"
        return GroupMember(seq.request_id, seq.assembly, seq.token_ids, self.kv.slots(seq, seq.num_tokens),
                           seq.num_exact_tokens, seq.tenant)

    def _decode_first_tokens(self, rows: list[tuple[Sequence, torch.Tensor]]) -> list[tuple[Sequence, torch.Tensor]]:
        """A prompt assembled around reused segments ends in the base model's hidden state.
        An ICaRus sequence samples its first token from its decoder instead: one decode
        pass over the finished prompt, whose base row rewrites its last token's own K/V
        (the value a plain prefill would have written) and whose decoder row reads them."""
        row_loras = [_decoder_lora(seq, first=True) for seq, _ in rows]  # None: it samples from its base row
        pending = [i for i, lora in enumerate(row_loras) if lora is not None]
        if not pending:
            return rows
        seqs = [rows[i][0] for i in pending]
        loras = [lora for lora in row_loras if lora is not None]  # pending's, in order
        contexts = [self.kv.slots(seq, seq.num_tokens) for seq in seqs]  # (T,) each
        num = len(seqs)
        tokens = [seq.token_ids[-1] for seq in seqs]
        positions = torch.tensor([seq.num_tokens - 1 for seq in seqs] * 2)  # (2 * num,)
        spans = [AdapterSpan(num + i, num + i + 1, lora) for i, lora in enumerate(loras)]
        meta = AttentionMetadata.build(torch.cat([c[-1:] for c in contexts]), [], contexts, list(range(num)))
        hidden = self.model(torch.tensor(tokens * 2, dtype=torch.long), positions, self.kv_cache.layers, meta,
                            AdapterRows(spans))  # (2 * num, hidden): base rows, then decoder rows
        rows = list(rows)
        for j, i in enumerate(pending):
            rows[i] = (seqs[j], hidden[num + j : num + j + 1])
        return rows

    def _run_batch(self, chunks: list[ScheduledChunk],
                   scored: list[tuple[list[torch.Tensor], torch.Tensor]] | None = None,
                   interrupt: Callable[[], bool] | None = None) -> list[tuple[Sequence, torch.Tensor]]:
        """One forward for every plain chunk. A multi-LoRA sequence's rows get its
        adapter's updates; an ICaRus sequence about to sample adds a decoder row (its
        token again, base + adapter, reading the base K/V and writing none) after every
        K/V row, and samples from it. Into `scored` go the final hidden states of the
        positions a teacher-forced sequence keeps logits of (`Sequence.logits_from`),
        but its last, whose sampled row keeps them, each with the list they go to."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        new_slots: list[torch.Tensor] = []
        prefill_chunks: list[tuple[int, torch.Tensor]] = []
        decode_contexts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        spans: list[AdapterSpan] = []
        decoders: list[DecoderRow] = []
        kept: list[tuple[list[torch.Tensor], int, int]] = []  # (a sequence's logits, first row, end row) it keeps
        for seq, num_tokens in chunks:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
            context = self.kv.slots(seq, end)  # (end,)
            row = len(input_ids)
            if scored is not None and seq.logits_from is not None and seq.logits is not None:
                first, last = max(start, seq.logits_from), min(end, seq.num_tokens - 1)
                if first < last:
                    kept.append((seq.logits, row + first - start, row + last - start))
            input_ids += seq.token_ids[start:end]
            positions.append(torch.arange(start, end))
            new_slots.append(context[start:])
            if num_tokens == 1:
                decode_contexts.append(context)
            else:
                prefill_chunks.append((num_tokens, context))
            adapter = seq.adapter
            if adapter is not None and not adapter.is_icarus:
                spans.append(AdapterSpan(row, row + num_tokens, adapter.lora))
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
                lora = _decoder_lora(seq, first=end == seq.num_prompt_tokens)
                if lora is not None:
                    decode = num_tokens == 1
                    source = len(decode_contexts) - 1 if decode else len(prefill_chunks) - 1
                    decoders.append(DecoderRow(lora, len(sample_rows) - 1, decode, source,
                                               seq.token_ids[end - 1], end - 1))
        # Decoder rows go after every K/V row: the decode entries' first, then the prefills'.
        decoders.sort(key=lambda d: not d.decode)
        num_kv = len(input_ids)
        entries: list[int] = []
        prefill_decoders: dict[int, int] = {}
        for i, decoder in enumerate(decoders):
            row = num_kv + i
            input_ids.append(decoder.token)
            positions.append(torch.tensor([decoder.position]))
            spans.append(AdapterSpan(row, row + 1, decoder.lora))
            if decoder.decode:
                entries.append(decoder.source)
            else:
                prefill_decoders[decoder.source] = row
            sample_rows[decoder.sample_index] = row
        meta = AttentionMetadata.build(torch.cat(new_slots), prefill_chunks, decode_contexts,
                                       entries or None, prefill_decoders or None)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long), torch.cat(positions), self.kv_cache.layers, meta,
            AdapterRows(spans) if spans else None, interrupt,
        )  # (N, hidden)
        if scored is not None:
            scored += [(logits, hidden[first:end]) for logits, first, end in kept]
        return [(seq, hidden[row : row + 1]) for seq, row in zip(sampling_seqs, sample_rows)]


def _decoder_lora(seq: Sequence, first: bool) -> LoraAdapter | None:
    """The adapter whose decoder query the sequence samples from, None when it samples
    from the base row: an ICaRus sequence does, except a first token its adapter asks of
    the base (the paper's variant)."""
    adapter = seq.adapter
    if adapter is None or not adapter.is_icarus or (first and adapter.spec.first_token == "base"):
        return None
    return adapter.lora

