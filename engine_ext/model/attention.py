"""Attention over the paged KV cache.

Each layer's cache is one flat tensor of slots (slot = block_id * block_size + offset),
so a sequence's keys are gathered by slot index in position order. Prefill chunks run
one sequence at a time (their query counts differ); decode tokens of all sequences run
as one padded batch, which is where continuous batching earns its throughput.

ICaRus decoder queries (engine_ext/adapters) ride along with the decode batch: each is
a second query of a decode entry, at the same position, over the same keys (the base
model's, its own token's included), and writes no K/V. Stacking it beside the base
query reads each entry's keys once, as the paper's head-concatenated queries do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from engine_ext.kernels.decode_attention import decode_attention
from engine_ext.kernels.prefill_attention import prefill_attention


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch of a step."""

    start: int  # index of its first query token in the flat batch
    num_tokens: int  # queries in this chunk
    context_slots: torch.Tensor  # (L,) slots of every key it attends to, cached ones first
    # (num_tokens,) int64: the last context index each query sees; None: the chunk's
    # queries are the last num_tokens positions of the context (a prefill chunk).
    positions: torch.Tensor | None = None

    @property
    def fresh(self) -> bool:
        """Nothing cached: the chunk's own new keys are its whole context (plain causal)."""
        return self.positions is None and self.context_slots.shape[0] == self.num_tokens

    def mask(self) -> torch.Tensor | None:
        """(num_tokens, L) bool, True where a query sees a key; None for a fresh chunk. Only
        torch's path needs it: the compiled kernel applies the rule from the positions."""
        if self.fresh:
            return None
        length = self.context_slots.shape[0]
        last = self.positions if self.positions is not None else torch.arange(length - self.num_tokens, length)
        return torch.arange(length)[None, :] <= last[:, None]  # (T, L)


@dataclass
class AttentionMetadata:
    """Where a step's new K/V go and which keys each query attends to."""

    slot_mapping: torch.Tensor  # (N,) cache slot of each new token
    prefills: list[PrefillSpan]
    decode_start: int  # decode tokens occupy [decode_start, N) of the flat batch
    decode_slots: torch.Tensor | None  # (B, Lmax) slots, padded with slot 0
    decode_mask: torch.Tensor | None  # (B, 1, 1, Lmax) True where the key is real
    decode_lengths: torch.Tensor | None = None  # (B,) int64 real keys per decode row
    # ICaRus decoder queries come after every row that writes K/V: first one per entry of
    # decoder_entries (M,) (the decode entry it joins), then one per prefill_decoders item
    # (span index -> its row), a query at the span's last position (the first token).
    decoder_entries: torch.Tensor | None = None
    prefill_decoders: dict[int, int] | None = None

    @property
    def num_kv_rows(self) -> int:
        """Rows of the flat batch whose K/V are written to the cache."""
        return self.slot_mapping.shape[0]

    @staticmethod
    def build(
        slot_mapping: torch.Tensor,
        prefill_chunks: list[tuple[int, torch.Tensor]],
        decode_contexts: list[torch.Tensor],
        decoder_entries: list[int] | None = None,
        prefill_decoders: dict[int, int] | None = None,
    ) -> AttentionMetadata:
        """prefill_chunks: (num_new_tokens, context slots (L,)) per prefilling sequence in
        batch order; decode_contexts: context slots (new token last) per decoding sequence,
        whose tokens follow all prefill tokens in the flat batch; decoder_entries: for
        each ICaRus decoder query (after the decode tokens), its decode entry's index;
        prefill_decoders: prefill span index -> the row of its last-position decoder query."""
        prefills: list[PrefillSpan] = []
        start = 0
        for num_tokens, slots in prefill_chunks:
            prefills.append(PrefillSpan(start, num_tokens, slots))  # query i sits at L - num_tokens + i
            start += num_tokens
        decode_slots = decode_mask = lengths = None
        if decode_contexts:
            decode_slots = pad_sequence(decode_contexts, batch_first=True)  # (B, Lmax), pad 0
            lengths = torch.tensor([c.shape[0] for c in decode_contexts])
            positions = torch.arange(decode_slots.shape[1])
            decode_mask = (positions[None, :] < lengths[:, None])[:, None, None, :]  # (B,1,1,Lmax)
        entries = torch.tensor(decoder_entries, dtype=torch.long) if decoder_entries else None
        return AttentionMetadata(slot_mapping, prefills, start, decode_slots, decode_mask, lengths, entries,
                                 prefill_decoders or None)


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q (N, heads, D); k_new/v_new (N, kv_heads, D), already written to the caches
    (num_slots, kv_heads, D). Returns (N, heads, D)."""
    out = torch.empty_like(q)
    for index, span in enumerate(meta.prefills):
        end = span.start + span.num_tokens
        queries = q[span.start : end]  # (T, heads, D)
        if span.fresh:  # nothing cached: the new keys are the whole context
            k_seq, v_seq = k_new[span.start : end], v_new[span.start : end]
        else:
            # index_select, not k_cache[idx]: advanced indexing is ~40x slower on CPU.
            k_seq = k_cache.index_select(0, span.context_slots)  # (L, kv_heads, D)
            v_seq = v_cache.index_select(0, span.context_slots)
        decoder_row = meta.prefill_decoders.get(index) if meta.prefill_decoders else None
        if decoder_row is None:  # the compiled kernel applies the causal rule without a mask
            direct = prefill_attention(queries, k_seq, v_seq, scale, span.positions)  # (T, heads, D) or None
            if direct is not None:
                out[span.start : end] = direct
                continue
        mask = span.mask()  # (T, L), or None: plain causal
        if decoder_row is not None:  # a second query at the last position, seeing what it sees
            queries = torch.cat([queries, q[decoder_row : decoder_row + 1]])  # (T + 1, heads, D)
            if mask is None:
                mask = torch.ones(span.num_tokens, span.num_tokens, dtype=torch.bool).tril()  # (T, T)
            mask = torch.cat([mask, mask[-1:]])  # (T + 1, L)
        o = F.scaled_dot_product_attention(
            queries.transpose(0, 1)[None],  # (1, heads, T', D)
            k_seq.transpose(0, 1)[None],  # (1, kv_heads, L, D)
            v_seq.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)  # (T', heads, D)
        out[span.start : end] = o[: span.num_tokens]
        if decoder_row is not None:
            out[decoder_row] = o[-1]
    if meta.decode_slots is not None:
        num_kv = meta.num_kv_rows
        q_dec = q[meta.decode_start : num_kv, :, None, :]  # (B, heads, 1, D)
        num_decoders = 0 if meta.decoder_entries is None else meta.decoder_entries.shape[0]
        if not num_decoders and meta.decode_lengths is not None:
            direct = decode_attention(q[meta.decode_start : num_kv], k_cache, v_cache, meta.decode_slots,
                                      meta.decode_lengths, scale)  # (B, heads, D) or None
            if direct is not None:
                out[meta.decode_start : num_kv] = direct
                return out
        if num_decoders:  # a second query per entry; unpaired ones repeat the first
            second = q_dec.clone()  # (B, heads, 1, D)
            second[meta.decoder_entries] = q[num_kv : num_kv + num_decoders, :, None, :]
            q_dec = torch.cat([q_dec, second], dim=2)  # (B, heads, 2, D)
        batch, max_len = meta.decode_slots.shape
        flat = meta.decode_slots.flatten()
        k_dec = k_cache.index_select(0, flat).view(batch, max_len, *k_cache.shape[1:]).transpose(1, 2)
        v_dec = v_cache.index_select(0, flat).view(batch, max_len, *v_cache.shape[1:]).transpose(1, 2)
        # k_dec, v_dec: (B, kv_heads, Lmax, D)
        # A lone sequence has no padding to mask: the unmasked kernel is quicker and the same.
        mask = None if batch == 1 else meta.decode_mask
        o = F.scaled_dot_product_attention(
            q_dec, k_dec, v_dec, attn_mask=mask, scale=scale, enable_gqa=True
        )  # (B, heads, 1 or 2, D)
        out[meta.decode_start : num_kv] = o[:, :, 0, :]
        if num_decoders:
            out[num_kv : num_kv + num_decoders] = o[meta.decoder_entries, :, 1, :]
    return out

