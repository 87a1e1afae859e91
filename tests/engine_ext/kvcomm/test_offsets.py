"""Corrections applied in one batched pass equal each applied alone, by the definition."""

from __future__ import annotations

import torch

from engine_ext.config import EngineConfig, ModelConfig
from engine_ext.kv.cache import KVCache
from engine_ext.kvcomm.offsets import ChunkedCorrection, Correction, Piece, apply_corrections
from engine_ext.rope import RopeShifter

MODEL = ModelConfig(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
                    tie_word_embeddings=False, qkv_bias=False, qk_norm=False)


def _cache(seed: int = 0) -> KVCache:
    cache = KVCache(MODEL, EngineConfig(kv_cache_bytes=64 * 4 * MODEL.kv_bytes_per_token(4), block_size=4))
    generator = torch.Generator().manual_seed(seed)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))
    return cache


def _reference(cache: KVCache, shifter: RopeShifter, piece: Piece) -> None:
    """The definition: for every corrected layer (not layer 0) and token t,
    K[t] += rotate(sum_a w[a, t] K[offset_a[t]], position) and V[t] += sum_a w[a, t] V[offset_a[t]]."""
    correction, dst, position = piece
    n = dst.shape[0]
    weights = correction.weights if correction.weights.dim() == 2 else correction.weights[:, None].expand(-1, n)
    for k, v in cache.layers[1:]:
        dk = sum(weights[a, :, None, None] * k[slots[:n]] for a, slots in enumerate(correction.offsets))
        dv = sum(weights[a, :, None, None] * v[slots[:n]] for a, slots in enumerate(correction.offsets))
        k[dst] = k[dst] + shifter.shift(dk, position)
        v[dst] = v[dst] + dv


def test_a_batch_of_pieces_with_different_anchor_counts_equals_each_alone():
    shifter = RopeShifter.for_model(MODEL)
    generator = torch.Generator().manual_seed(1)
    chunked = ChunkedCorrection([
        (0, Correction([torch.arange(100, 108), torch.arange(120, 128), torch.arange(140, 148)],
                       torch.rand(3, 8, generator=generator))),
        (8, Correction([torch.arange(160, 165)], torch.ones(1))),  # an exact anchor: its offsets alone
    ])
    whole = Correction([torch.arange(180, 186), torch.arange(200, 206)], torch.tensor([0.25, 0.75]))
    pieces = chunked.pieces(torch.arange(0, 13), 40) + whole.pieces(torch.arange(20, 26), 70)
    assert [(p.dst.tolist()[0], p.position) for p in pieces] == [(0, 40), (8, 48), (20, 70)]

    batched, alone = _cache(), _cache()
    apply_corrections(batched, shifter, pieces)
    for piece in pieces:
        _reference(alone, shifter, piece)
    for (kb, vb), (ka, va) in zip(batched.layers, alone.layers):
        torch.testing.assert_close(kb, ka, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vb, va, atol=1e-5, rtol=1e-5)
    untouched = _cache()
    assert torch.equal(batched.layers[0][0], untouched.layers[0][0])  # layer 0 is never corrected
    # The exact anchor's values are base + its offset, bit for bit, despite the padding beside it.
    assert torch.equal(batched.layers[1][1][8:13], untouched.layers[1][1][8:13] + untouched.layers[1][1][160:165])


def test_no_piece_changes_nothing():
    cache, before = _cache(), _cache()
    apply_corrections(cache, RopeShifter.for_model(MODEL), [Piece(Correction([torch.arange(4)], torch.ones(1)),
                                                                  torch.empty(0, dtype=torch.long), 3)])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(cache.layers, before.layers))
