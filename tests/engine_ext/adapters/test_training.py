"""Adapter training: the ICaRus forward is the served decoder's, the loss falls, PEFT output."""

from __future__ import annotations

import torch

from engine_ext.adapters import load_lora
from engine_ext.adapters.training import LoraFactors, forward_logits, train
from engine_ext.config import EngineConfig
from engine_ext.kv.cache import KVCache
from engine_ext.model import AttentionMetadata
from tests.engine_ext.adapters.test_lora import CFG
from tests.engine_ext.adapters.test_rows import _merged, _model

TOKENS = [3, 9, 4, 1, 22, 7, 5, 30, 2]


def _factors(model, seed: int) -> LoraFactors:
    factors = LoraFactors(model, rank=4, alpha=8.0, modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in factors.b.values():
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return factors


def test_the_icarus_forward_is_the_served_decoder_over_the_base_cache(tmp_path):
    model = _model()
    factors = _factors(model, seed=3)
    factors.save(tmp_path / "a")
    decoder = _merged(model, load_lora(tmp_path / "a", CFG, "a"))
    trained = forward_logits(model, factors, torch.tensor(TOKENS), "icarus")  # (T, vocab)
    cache = KVCache(CFG, EngineConfig(kv_cache_bytes=8 * 2 * CFG.num_layers * 16 * 2 * 8 * 4, block_size=16))
    slots = torch.arange(len(TOKENS))
    model(torch.tensor(TOKENS), slots, cache.layers, AttentionMetadata.build(slots, [(len(TOKENS), slots)], []))
    scratch = torch.tensor([100])
    for p in range(len(TOKENS)):  # the decoder's query at p over the base keys 0..p
        meta = AttentionMetadata.build(scratch, [], [slots[: p + 1]])
        hidden = decoder(torch.tensor(TOKENS[p : p + 1]), torch.tensor([p]), cache.layers, meta)
        torch.testing.assert_close(trained[p : p + 1], decoder.compute_logits(hidden), rtol=1e-4, atol=1e-4)


def test_the_lora_forward_is_the_merged_model(tmp_path):
    model = _model()
    factors = _factors(model, seed=5)
    factors.save(tmp_path / "a")
    merged = _merged(model, load_lora(tmp_path / "a", CFG, "a"))
    trained = forward_logits(model, factors, torch.tensor(TOKENS), "lora")
    plain = forward_logits(merged, None, torch.tensor(TOKENS), "lora")
    torch.testing.assert_close(trained, plain, rtol=1e-4, atol=1e-4)


def test_training_lowers_the_loss_and_writes_a_peft_adapter(tmp_path):
    examples = [([3, 9, 4, 1], [22, 7, 5]), ([8, 8, 2], [30, 1, 6, 11]), ([5, 5, 5, 5], [40, 41])]
    for mode in ("icarus", "lora"):
        factors, losses = train(_model(), examples, mode, rank=4, steps=30, lr=2e-2)
        assert losses[-1] < 0.75 * losses[0], (mode, losses)  # about 4.2 -> 2.8 on this random model
        factors.save(tmp_path / mode)
        adapter = load_lora(tmp_path / mode, CFG, mode)
        assert adapter.rank == 4 and len(adapter.parts) == CFG.num_layers * 4
