"""engine_ext.kernels.prefill_attention: queries at the last positions of their context,
or at any given positions, equal causal softmax attention in float64 (GQA heads
included); each query row is bitwise the same however the prompt is chunked and on any
thread count; the kernel declines what it does not handle."""

from __future__ import annotations

import math

import pytest
import torch

from engine_ext.kernels.compiled import load_library
from engine_ext.kernels.prefill_attention import prefill_attention

pytestmark = pytest.mark.skipif(load_library() is None, reason="no compiled kernel on this CPU")

HEADS, KV_HEADS = 6, 2


def _qkv(tokens: int, length: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, HEADS, dim, generator=g) * 2, torch.randn(length, KV_HEADS, dim, generator=g) * 2,
            torch.randn(length, KV_HEADS, dim, generator=g))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 softmax over the keys each query may see: up to positions[t], by default
    L - T + t."""
    tokens, length, group = q.shape[0], k.shape[0], HEADS // KV_HEADS
    if positions is None:
        positions = torch.arange(length - tokens, length)
    seen = torch.arange(length)[None, :] <= positions[:, None]  # (T, L)
    keys = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
    values = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) * scale  # (H, T, L)
    weights = torch.softmax(scores.masked_fill(~seen, -math.inf), dim=-1)
    return (weights @ values).transpose(0, 1).float()  # (T, H, D)


@pytest.mark.parametrize(("tokens", "length", "dim"), [
    (1, 1, 16), (7, 7, 16), (130, 130, 64), (33, 300, 64), (1, 257, 32), (64, 128, 128), (40, 40, 256),
])
@torch.inference_mode()
def test_equals_causal_softmax_attention(tokens: int, length: int, dim: int) -> None:
    q, k, v = _qkv(tokens, length, dim)
    scale = 1 / math.sqrt(dim)
    got = prefill_attention(q, k, v, scale)
    assert got is not None and got.shape == q.shape
    torch.testing.assert_close(got, _reference(q, k, v, scale), rtol=2e-5, atol=2e-5)


@torch.inference_mode()
def test_queries_at_any_positions_see_up_to_their_own() -> None:
    """A reuse method recomputes scattered rows over a whole context: each sees the keys up
    to its own position, and equals the same row of a full prefill, bit for bit."""
    q, k, v = _qkv(400, 400, 64, seed=2)
    rows = torch.tensor([0, 3, 64, 127, 128, 129, 250, 255, 256, 399])
    got = prefill_attention(q[rows], k, v, 0.125, rows)
    assert got is not None
    torch.testing.assert_close(got, _reference(q[rows], k, v, 0.125, rows), rtol=2e-5, atol=2e-5)
    full = prefill_attention(q, k, v, 0.125)
    assert full is not None and torch.equal(got, full[rows])
    shuffled = rows.flip(0)  # any order: each row's own positions decide
    again = prefill_attention(q[shuffled], k, v, 0.125, shuffled)
    assert again is not None and torch.equal(again, got.flip(0))


@torch.inference_mode()
def test_a_row_is_bitwise_the_same_however_the_prompt_is_chunked() -> None:
    """A whole prompt, the same prompt in uneven chunks, and a prefix hit's tail: every
    query row gives the same bits."""
    q, k, v = _qkv(300, 300, 64, seed=3)
    whole = prefill_attention(q, k, v, 0.125)
    assert whole is not None
    for cuts in ([0, 1, 129, 130, 300], [0, 37, 256, 299, 300], [0, 250, 300]):
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            part = prefill_attention(q[lo:hi], k[:hi], v[:hi], 0.125)
            assert part is not None
            assert torch.equal(part, whole[lo:hi]), (lo, hi)


@torch.inference_mode()
def test_the_same_bits_on_one_thread_or_two() -> None:
    q, k, v = _qkv(200, 450, 64, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = prefill_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert one is not None and two is not None and torch.equal(one, two)


@torch.inference_mode()
def test_a_huge_score_gap_weights_the_top_key_alone() -> None:
    """Scores far apart underflow to exactly 0 weight, not to NaN or a denormal mess."""
    q, k, v = _qkv(4, 200, 16, seed=7)
    q[:] = 0.0
    k[10] = 50.0
    q[:, :, 0] = 50.0
    got = prefill_attention(q, k, v, 1.0)
    assert got is not None and torch.isfinite(got).all()
    torch.testing.assert_close(got, v[10].repeat_interleave(HEADS // KV_HEADS, dim=0).expand_as(got))


@torch.inference_mode()
def test_declines_what_it_does_not_handle() -> None:
    q, k, v = _qkv(8, 8, 16)
    assert prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.25) is None  # another dtype
    q40, k40, v40 = _qkv(8, 8, 40)
    assert prefill_attention(q40, k40, v40, 0.25) is None  # head size not a multiple of 16
    q512, k512, v512 = _qkv(2, 2, 512)
    assert prefill_attention(q512, k512, v512, 0.25) is None  # beyond the kernel's 256
    assert prefill_attention(q, k[:4], v[:4], 0.25) is None  # more queries than context
    assert prefill_attention(q[:2], k, v, 0.25, torch.tensor([0, 8])) is None  # a position past the context
    assert prefill_attention(q[:2], k, v, 0.25, torch.tensor([-1, 3])) is None


def test_declines_under_autograd() -> None:
    q, k, v = _qkv(8, 8, 16)
    with torch.enable_grad():
        assert prefill_attention(q.requires_grad_(), k, v, 0.25) is None
