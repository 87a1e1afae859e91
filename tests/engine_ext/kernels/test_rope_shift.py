"""engine_ext.kernels.rope_shift: shifting post-RoPE keys by a delta equals rotating the pre-RoPE
keys at the new position (the torch reference), and the Triton kernel computes exactly
what the reference does (run on CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from engine_ext.config import RopeConfig
from engine_ext.kernels import triton_available
from engine_ext.kernels.rope import apply_rotary, rope_cos_sin, rope_inv_freq
from engine_ext.kernels.rope_shift import shift_keys, shift_keys_torch

HEAD_DIM = 64
# Positions stay below 32 so that atol 1e-5 holds with a 2x margin: fp32 angles
# p * theta_i are rounded to half an ulp of the angle, which grows with the position
# (worst case over 30 seeds: 4.9e-6 below 32, 1.1e-5 below 48; see
# tests/kernels/test_rope.py::test_shift_property for the large-position tolerances).
MAX_POS = 32

ROPES = {
    "default": (RopeConfig(theta=10000.0), HEAD_DIM),
    "linear": (RopeConfig(theta=10000.0, rope_type="linear", factor=4.0), HEAD_DIM),
    # original_max_position_embeddings=64 puts the frequencies in all three llama3 bands.
    "llama3": (RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64), HEAD_DIM),
    "partial": (RopeConfig(theta=10000.0, partial_rotary_factor=0.5), HEAD_DIM // 2),
}


def _positions_and_deltas(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token old positions p and deltas d, negative ones included, with 0 <= p + d < MAX_POS."""
    p = torch.randint(0, MAX_POS, (n,), generator=gen)
    new = torch.randint(0, MAX_POS, (n,), generator=gen)
    return p, new - p


@pytest.mark.parametrize("name", list(ROPES))
def test_shift_equals_rotation_at_the_new_position(name):
    rope, rotary_dim = ROPES[name]
    inv_freq = rope_inv_freq(rope, rotary_dim)
    gen = torch.Generator().manual_seed(0)
    n = 300
    k = torch.randn(n, 3, HEAD_DIM, generator=gen)  # pre-RoPE keys
    p, d = _positions_and_deltas(n, gen)
    assert (d < 0).any() and (d > 0).any() and d.unique().numel() > 30

    at_p = apply_rotary(k, *rope_cos_sin(inv_freq, p))
    shifted = shift_keys_torch(at_p, d, inv_freq)
    direct = apply_rotary(k, *rope_cos_sin(inv_freq, p + d))
    assert shifted.dtype == torch.float32 and shifted.shape == k.shape
    torch.testing.assert_close(shifted, direct, rtol=0, atol=1e-5)
    if rotary_dim < HEAD_DIM:  # channels past rotary_dim carry no position
        assert torch.equal(shifted[..., rotary_dim:], k[..., rotary_dim:])


def test_shifting_back_by_the_position_recovers_the_pre_rope_keys():
    inv_freq = rope_inv_freq(RopeConfig(), HEAD_DIM)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(40, 2, HEAD_DIM, generator=gen)
    p = torch.randint(0, MAX_POS, (40,), generator=gen)
    back = shift_keys_torch(apply_rotary(k, *rope_cos_sin(inv_freq, p)), -p, inv_freq)
    torch.testing.assert_close(back, k, rtol=0, atol=1e-5)


def test_each_token_gets_its_own_delta():
    """A (n,) delta shifts token i by delta[i] alone, as n single-token shifts would."""
    inv_freq = rope_inv_freq(RopeConfig(), HEAD_DIM)
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(6, 2, HEAD_DIM, generator=gen)
    delta = torch.tensor([0, 5, -3, 17, -40, 1])
    out = shift_keys_torch(keys, delta, inv_freq)
    for i, d in enumerate(delta.tolist()):
        one = shift_keys_torch(keys[i : i + 1], torch.tensor([d]), inv_freq)
        assert torch.equal(out[i : i + 1], one)
    assert torch.equal(out[0], keys[0])  # delta 0 is the identity


def test_low_precision_keys_keep_their_dtype():
    inv_freq = rope_inv_freq(RopeConfig(), HEAD_DIM)
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(8, 2, HEAD_DIM, generator=gen).to(torch.bfloat16)
    delta = torch.randint(-30, 30, (8,), generator=gen)
    out = shift_keys_torch(keys, delta, inv_freq)
    assert out.dtype == torch.bfloat16
    # the rotation runs in fp32 and rounds once at the end
    assert torch.equal(out, shift_keys_torch(keys.float(), delta, inv_freq).to(torch.bfloat16))


def test_dispatcher_uses_the_torch_reference_on_cpu():
    inv_freq = rope_inv_freq(RopeConfig(), HEAD_DIM)
    keys = torch.randn(5, 2, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    delta = torch.tensor([3, -1, 0, 9, 2])
    assert torch.equal(shift_keys(keys, delta, inv_freq), shift_keys_torch(keys, delta, inv_freq))


def test_triton_available_reports_the_install():
    assert triton_available() is (importlib.util.find_spec("triton") is not None)


# --- the Triton kernel, interpreted on CPU ---------------------------------------------

TRITON_MODULE = "engine_ext.kernels.rope_shift_triton"


@pytest.fixture
def shift_keys_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., torch.Tensor]]:
    """shift_keys_triton from a fresh import under TRITON_INTERPRET=1: triton.jit decides
    between compiling and interpreting when the kernel is defined, i.e. at import. The
    interpreted module is dropped afterwards so no later import sees it."""
    pytest.importorskip("triton", reason="triton is not installed (optional extra: pip install kvrelay[triton])")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delitem(sys.modules, TRITON_MODULE, raising=False)
    module = importlib.import_module(TRITON_MODULE)
    yield module.shift_keys_triton
    sys.modules.pop(TRITON_MODULE, None)  # monkeypatch then restores any earlier import


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """fp32: the kernel's sin/cos and products may differ from torch's by an ulp. bf16/fp16:
    that ulp of fp32 can flip the final rounding, i.e. one ulp of the output dtype."""
    if dtype == torch.float32:
        return {"rtol": 0.0, "atol": 1e-6}
    return {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["default", "llama3", "partial"])
@pytest.mark.parametrize("num_heads", [1, 5, 20])  # 20 > MAX_BLOCK_H: two head blocks
def test_triton_kernel_matches_the_reference(shift_keys_triton, name, num_heads, dtype):
    rope, rotary_dim = ROPES[name]
    inv_freq = rope_inv_freq(rope, rotary_dim)
    gen = torch.Generator().manual_seed(5)
    n = 24
    keys = torch.randn(n, num_heads, HEAD_DIM, generator=gen).to(dtype)
    delta = torch.randint(-5000, 5000, (n,), generator=gen)
    out = shift_keys_triton(keys, delta, inv_freq)
    ref = shift_keys_torch(keys, delta, inv_freq)
    assert out.dtype == dtype and out.shape == keys.shape
    torch.testing.assert_close(out, ref, **_tolerance(dtype))
    assert torch.equal(out[..., rotary_dim:], keys[..., rotary_dim:])


def test_triton_kernel_reads_strided_keys(shift_keys_triton):
    """Keys sliced out of a larger cache tensor (non-contiguous) are read through their strides."""
    inv_freq = rope_inv_freq(RopeConfig(), HEAD_DIM)
    gen = torch.Generator().manual_seed(6)
    cache = torch.randn(16, 2, 3, HEAD_DIM, generator=gen)  # (n, K/V, kv_heads, head_dim)
    keys = cache[:, 0]  # (n, kv_heads, head_dim), not contiguous
    assert not keys.is_contiguous()
    delta = torch.arange(16) * 7 - 50
    out = shift_keys_triton(keys, delta, inv_freq)
    torch.testing.assert_close(out, shift_keys_torch(keys, delta, inv_freq), **_tolerance(torch.float32))


def test_triton_kernel_edge_cases(shift_keys_triton):
    inv_freq = rope_inv_freq(RopeConfig(), HEAD_DIM)
    empty = torch.empty(0, 2, HEAD_DIM)
    assert shift_keys_triton(empty, torch.empty(0, dtype=torch.long), inv_freq).shape == (0, 2, HEAD_DIM)
    keys = torch.randn(3, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="delta"):
        shift_keys_triton(keys, torch.zeros(4, dtype=torch.long), inv_freq)
    with pytest.raises(ValueError, match="rotary_dim"):
        shift_keys_triton(keys, torch.zeros(3, dtype=torch.long), torch.ones(HEAD_DIM))
