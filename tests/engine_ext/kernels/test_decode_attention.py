"""engine_ext.kernels.decode_attention: one query per sequence over the paged cache equals
torch's softmax attention over the gathered keys, reads each sequence's own slots (GQA
heads included), and gives a sequence bitwise the same result alone or in any batch."""

from __future__ import annotations

import math

import pytest
import torch

from engine_ext.kernels.compiled import load_library
from engine_ext.kernels.decode_attention import decode_attention

pytestmark = pytest.mark.skipif(load_library() is None, reason="no compiled kernel on this CPU")

HEADS, KV_HEADS, DIM, SLOTS = 6, 2, 48, 512  # three vectors of 16 lanes, not a power of two


def _cache(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SLOTS, KV_HEADS, DIM, generator=g), torch.randn(SLOTS, KV_HEADS, DIM, generator=g)


def _contexts(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    """Each sequence's slots: scattered, distinct, in position order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(SLOTS, generator=g)[:n] for n in lengths]


def _padded(contexts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(c.shape[0] for c in contexts)
    slots = torch.zeros(len(contexts), width, dtype=torch.int64)
    for i, c in enumerate(contexts):
        slots[i, : c.shape[0]] = c
    return slots, torch.tensor([c.shape[0] for c in contexts])


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, contexts: list[torch.Tensor],
               scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    for b, ctx in enumerate(contexts):
        for h in range(HEADS):
            keys, values = k[ctx, h // group].double(), v[ctx, h // group].double()  # (L, D)
            weights = torch.softmax(keys @ q[b, h].double() * scale, dim=0)  # (L,)
            out[b, h] = (weights @ values).float()
    return out


@torch.inference_mode()
def test_equals_softmax_attention_over_each_sequences_own_slots() -> None:
    k, v = _cache()
    contexts = _contexts([1, 7, 16, 33, 130])  # whole vectors of scores and tails
    q = torch.randn(len(contexts), HEADS, DIM)
    slots, lengths = _padded(contexts)
    scale = 1 / math.sqrt(DIM)
    got = decode_attention(q, k, v, slots, lengths, scale)
    assert got is not None
    torch.testing.assert_close(got, _reference(q, k, v, contexts, scale), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch() -> None:
    k, v = _cache()
    contexts = _contexts([5, 64, 17, 90, 3])
    q = torch.randn(len(contexts), HEADS, DIM)
    slots, lengths = _padded(contexts)
    batched = decode_attention(q, k, v, slots, lengths, 0.125)
    assert batched is not None
    threads_before = torch.get_num_threads()
    try:
        for b, ctx in enumerate(contexts):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                alone = decode_attention(q[b : b + 1], k, v, ctx[None], torch.tensor([ctx.shape[0]]), 0.125)
                assert alone is not None and torch.equal(alone[0], batched[b])
    finally:
        torch.set_num_threads(threads_before)


def test_declines_what_it_does_not_compute() -> None:
    """bf16 caches, autograd, a head size that is not whole vectors and more than 8 query
    heads per KV head take torch's path (None)."""
    k, v = _cache()
    slots, lengths = _padded(_contexts([4]))
    q = torch.randn(1, HEADS, DIM)
    with torch.inference_mode():
        assert decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), slots, lengths, 0.1) is None
    with torch.enable_grad():
        assert decode_attention(q.requires_grad_(), k, v, slots, lengths, 0.1) is None
    with torch.inference_mode():
        assert decode_attention(q[..., :40], k[..., :40].contiguous(), v[..., :40].contiguous(), slots, lengths,
                                0.1) is None
        wide = torch.randn(1, 18, DIM)  # 18 query heads over 2 KV heads: 9 a group
        assert decode_attention(wide, k, v, slots, lengths, 0.1) is None
