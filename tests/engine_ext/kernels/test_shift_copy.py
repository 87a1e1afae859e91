"""engine_ext.kernels.shift_copy: the batched paged RoPE shift is exactly gather, `shift_keys_torch`,
scatter (the torch reference), and the Triton kernel computes what the reference does
(run on CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from engine_ext.config import RopeConfig
from engine_ext.kernels.rope import rope_inv_freq
from engine_ext.kernels.rope_shift import shift_keys_torch
from engine_ext.kernels.shift_copy import shift_copy, shift_copy_torch

NUM_SLOTS = 160
KV_HEADS = 3


def _round(
    n: int, head_dim: int, seed: int, dtype: torch.dtype = torch.float32, num_heads: int = KV_HEADS
) -> tuple[torch.Tensor, ...]:
    """Caches (NUM_SLOTS, num_heads, head_dim) and one All-Gather round of n moves: src,
    dst and delta (n,), src and dst distinct, disjoint slots."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_SLOTS, num_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_SLOTS, num_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(NUM_SLOTS, generator=gen)
    src, dst = slots[:n], slots[n : 2 * n]
    delta = torch.randint(-5000, 5000, (n,), generator=gen)
    return k_cache, v_cache, src, dst, delta


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (32, 32), (64, 32)])
def test_reference_is_gather_shift_scatter(head_dim, rotary_dim):
    inv_freq = rope_inv_freq(RopeConfig(), rotary_dim)
    k_cache, v_cache, src, dst, delta = _round(70, head_dim, seed=0)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    k_want.index_copy_(0, dst, shift_keys_torch(k_want.index_select(0, src), delta, inv_freq))
    v_want.index_copy_(0, dst, v_want.index_select(0, src))
    shift_copy_torch(k_cache, v_cache, src, dst, delta, inv_freq)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_only_the_rotary_channels_of_the_keys_move():
    """Partial rotary: the tail of K, all of V and every row outside dst stay bit for bit."""
    inv_freq = rope_inv_freq(RopeConfig(partial_rotary_factor=0.5), 32)
    k_cache, v_cache, src, dst, delta = _round(50, 64, seed=1)
    k_old, v_old = k_cache.clone(), v_cache.clone()
    shift_copy_torch(k_cache, v_cache, src, dst, delta, inv_freq)
    assert torch.equal(k_cache[dst, :, 32:], k_old[src, :, 32:])
    assert not torch.allclose(k_cache[dst, :, :32], k_old[src, :, :32])
    assert torch.equal(v_cache[dst], v_old[src])
    kept = torch.ones(NUM_SLOTS, dtype=torch.bool)
    kept[dst] = False
    assert torch.equal(k_cache[kept], k_old[kept]) and torch.equal(v_cache[kept], v_old[kept])


def test_delta_zero_moves_finite_keys_unchanged():
    """cos 0 = 1 and sin 0 = 0 exactly, so finite keys come back equal (signed zeros aside:
    -0.0 + 0.0 is +0.0, which torch.equal does not tell apart)."""
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    k_cache, v_cache, src, dst, _ = _round(20, 64, seed=2, dtype=torch.bfloat16)
    shift_copy_torch(k_cache, v_cache, src, dst, torch.zeros(20, dtype=torch.long), inv_freq)
    assert torch.equal(k_cache[dst], k_cache[src])


def test_dispatcher_uses_the_torch_reference_on_cpu():
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    k_cache, v_cache, src, dst, delta = _round(30, 64, seed=3)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    shift_copy(k_cache, v_cache, src, dst, delta, inv_freq)
    shift_copy_torch(k_ref, v_ref, src, dst, delta, inv_freq)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_bad_arguments_are_named():
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    k_cache, v_cache, src, dst, delta = _round(10, 64, seed=4)
    with pytest.raises(ValueError, match="dst"):
        shift_copy_torch(k_cache, v_cache, src, dst[:9], delta, inv_freq)
    with pytest.raises(ValueError, match="v_cache"):
        shift_copy_torch(k_cache, v_cache[:, :2], src, dst, delta, inv_freq)
    with pytest.raises(ValueError, match="rotary_dim"):
        shift_copy_torch(k_cache, v_cache, src, dst, delta, torch.ones(64))


# --- the Triton kernel, interpreted on CPU ---------------------------------------------

TRITON_MODULE = "engine_ext.kernels.shift_copy_triton"


@pytest.fixture
def shift_copy_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """shift_copy_triton from a fresh import under TRITON_INTERPRET=1: triton.jit decides
    between compiling and interpreting when the kernel is defined, i.e. at import. The
    interpreted module is dropped afterwards so no later import sees it."""
    pytest.importorskip("triton", reason="triton is not installed (optional extra: pip install kvrelay[triton])")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delitem(sys.modules, TRITON_MODULE, raising=False)
    module = importlib.import_module(TRITON_MODULE)
    yield module.shift_copy_triton
    sys.modules.pop(TRITON_MODULE, None)  # monkeypatch then restores any earlier import


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "rotary_dim", "num_heads"), [(64, 64, 3), (64, 32, 3), (32, 32, 20)])
def test_triton_kernel_matches_the_reference(shift_copy_triton, head_dim, rotary_dim, num_heads, dtype):
    """K's rotary channels to the kernel's sin/cos (an fp32 ulp; one ulp of bf16 when that
    flips the rounding); K's tail, V and the untouched rows bit for bit. 20 heads: three
    head blocks."""
    inv_freq = rope_inv_freq(RopeConfig(), rotary_dim)
    k_cache, v_cache, src, dst, delta = _round(70, head_dim, seed=5, dtype=dtype, num_heads=num_heads)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    shift_copy_triton(k_cache, v_cache, src, dst, delta, inv_freq)
    shift_copy_torch(k_ref, v_ref, src, dst, delta, inv_freq)
    tol = {"rtol": 0.0, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-5}
    torch.testing.assert_close(k_cache, k_ref, **tol)
    assert torch.equal(k_cache[..., rotary_dim:], k_ref[..., rotary_dim:])
    assert torch.equal(v_cache, v_ref)
    kept = torch.ones(NUM_SLOTS, dtype=torch.bool)
    kept[dst] = False
    assert torch.equal(k_cache[kept], k_ref[kept])


def test_triton_kernel_edge_cases(shift_copy_triton):
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    k_cache, v_cache, src, dst, delta = _round(10, 64, seed=6)
    k_old = k_cache.clone()
    empty = torch.empty(0, dtype=torch.long)
    shift_copy_triton(k_cache, v_cache, empty, empty, empty, inv_freq)
    assert torch.equal(k_cache, k_old)
    with pytest.raises(ValueError, match="delta"):
        shift_copy_triton(k_cache, v_cache, src, dst, delta[:3], inv_freq)
    with pytest.raises(ValueError, match="contiguous"):
        shift_copy_triton(k_cache.transpose(0, 1).contiguous().transpose(0, 1), v_cache, src, dst, delta, inv_freq)
    with pytest.raises(ValueError, match="k_cache"):
        shift_copy_triton(k_cache[0], v_cache[0], src, dst, delta, inv_freq)
