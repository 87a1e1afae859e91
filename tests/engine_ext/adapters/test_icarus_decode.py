"""ICaRus decode: a base row writes the shared K/V, its decoder row (base + adapter) reads
them in the same pass; equal to running the logical encoder and decoder separately."""

from __future__ import annotations

import torch

from engine_ext.adapters import load_lora
from engine_ext.adapters.rows import AdapterRows, AdapterSpan
from engine_ext.config import EngineConfig
from engine_ext.kv.cache import KVCache
from engine_ext.model import AttentionMetadata
from tests.engine_ext.adapters.test_lora import CFG, write_adapter
from tests.engine_ext.adapters.test_rows import _merged, _model

PROMPTS = ([3, 9, 4, 1, 22, 7, 5], [8, 8, 2, 30, 1])
NEXT = (12, 40)  # each sequence's current token
SCRATCH = 1000  # a slot the reference decoder writes into, outside every context


def _cache() -> KVCache:
    return KVCache(CFG, EngineConfig(kv_cache_bytes=80 * 2 * CFG.num_layers * 16 * 2 * 8 * 4, block_size=16))


def _prefilled(model) -> tuple[KVCache, list[torch.Tensor]]:
    cache = _cache()
    slots = [torch.arange(i * 64, i * 64 + len(p)) for i, p in enumerate(PROMPTS)]
    meta = AttentionMetadata.build(torch.cat(slots), [(len(p), s) for p, s in zip(PROMPTS, slots)], [])
    model(torch.tensor([t for p in PROMPTS for t in p]), torch.cat([torch.arange(len(p)) for p in PROMPTS]),
          cache.layers, meta)
    return cache, slots


def test_paired_decode_equals_separate_encoder_and_decoder(tmp_path):
    write_adapter(tmp_path / "math", seed=4)
    adapter = load_lora(tmp_path / "math", CFG, "math")
    model = _model()
    ids = torch.tensor(NEXT)
    positions = torch.tensor([len(p) for p in PROMPTS])
    new_slots = torch.tensor([i * 64 + len(p) for i, p in enumerate(PROMPTS)])

    # Reference: the encoder (base) decodes both tokens, writing their K/V; then the
    # decoder (merged adapter) reads the very same keys, writing only to a scratch slot.
    ref_cache, slots = _prefilled(model)
    contexts = [torch.cat([s, new_slots[i : i + 1]]) for i, s in enumerate(slots)]
    base_hidden = model(ids, positions, ref_cache.layers, AttentionMetadata.build(new_slots, [], contexts))
    decoder = _merged(model, adapter)
    ref_decoder = []
    for i in range(2):
        snapshot = [(k.clone(), v.clone()) for k, v in ref_cache.layers]
        meta = AttentionMetadata.build(torch.tensor([SCRATCH]), [], [contexts[i]])
        ref_decoder.append(decoder(ids[i : i + 1], positions[i : i + 1], snapshot, meta))

    # ICaRus: one pass, base rows first (they write K/V), then the decoder row of entry 1 only.
    cache, _ = _prefilled(model)
    flat_ids = torch.tensor([NEXT[0], NEXT[1], NEXT[1]])
    flat_pos = torch.cat([positions, positions[1:]])
    meta = AttentionMetadata.build(new_slots, [], contexts, decoder_entries=[1])
    hidden = model(flat_ids, flat_pos, cache.layers, meta, AdapterRows([AdapterSpan(2, 3, adapter)]))

    torch.testing.assert_close(hidden[:2], base_hidden)
    torch.testing.assert_close(hidden[2:], ref_decoder[1], rtol=1e-4, atol=1e-4)
    for (k, v), (rk, rv) in zip(cache.layers, ref_cache.layers):  # the decoder row wrote nothing
        torch.testing.assert_close(k, rk)
        torch.testing.assert_close(v, rv)
    assert not torch.allclose(hidden[2:], hidden[1:2], atol=1e-3)  # the adapter changed the prediction


def test_first_token_decoder_query_at_the_end_of_a_prefill(tmp_path):
    write_adapter(tmp_path / "code", seed=5)
    adapter = load_lora(tmp_path / "code", CFG, "code")
    model = _model()
    prompt = PROMPTS[0]
    slots = torch.arange(len(prompt))
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))

    ref_cache = _cache()
    base_hidden = model(ids, positions, ref_cache.layers, AttentionMetadata.build(slots, [(len(prompt), slots)], []))
    # Reference decoder: the merged model's query for the last prompt token over the base K/V.
    snapshot = [(k.clone(), v.clone()) for k, v in ref_cache.layers]
    meta = AttentionMetadata.build(torch.tensor([SCRATCH]), [], [slots])
    ref_decoder = _merged(model, adapter)(ids[-1:], positions[-1:], snapshot, meta)

    cache = _cache()
    meta = AttentionMetadata.build(slots, [(len(prompt), slots)], [], prefill_decoders={0: len(prompt)})
    hidden = model(torch.cat([ids, ids[-1:]]), torch.cat([positions, positions[-1:]]), cache.layers, meta,
                   AdapterRows([AdapterSpan(len(prompt), len(prompt) + 1, adapter)]))
    torch.testing.assert_close(hidden[:-1], base_hidden)
    torch.testing.assert_close(hidden[-1:], ref_decoder, rtol=1e-4, atol=1e-4)
    for (k, v), (rk, rv) in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(k, rk)
        torch.testing.assert_close(v, rv)
