"""The compiled elementwise kernels: rotary gives bitwise the result of torch's ops (also
on a strided view into a fused projection, and with one angle set for every token), and
SwiGLU equals silu(gate) * up within float rounding, including the tails and extremes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_ext.kernels import rope
from engine_ext.kernels.compiled import load_library
from engine_ext.kernels.swiglu import swiglu

pytestmark = pytest.mark.skipif(load_library() is None, reason="no compiled kernel on this CPU")


def _torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():  # autograd on: apply_rotary keeps to torch's ops
        assert rope._compiled_rotary(x, cos, sin) is None
        return rope.apply_rotary(x, cos, sin).detach()


@pytest.mark.parametrize(("rotary_dim", "one_angle_set"), [(16, False), (8, False), (16, True)])
@torch.inference_mode()
def test_rotary_is_bitwise_torchs(rotary_dim: int, one_angle_set: bool) -> None:
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(37, 6 * 16 + 2 * 16, generator=g)  # (N, heads * D + v): a qkv projection
    x = fused[:, : 6 * 16].view(37, 6, 16)  # a strided view: each token's heads contiguous
    positions = torch.arange(1000, 1037) if not one_angle_set else torch.tensor([5])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = rope.rope_cos_sin(inv_freq, positions)
    got = rope.apply_rotary(x, cos, sin)
    assert rope._compiled_rotary(x, cos, sin) is not None  # the kernel ran
    assert torch.equal(got, _torch_rotary(x.clone(), cos, sin))


@torch.inference_mode()
def test_rotary_declines_other_dtypes_and_layouts() -> None:
    cos, sin = torch.ones(4, 16), torch.zeros(4, 16)
    assert rope._compiled_rotary(torch.randn(4, 2, 16).bfloat16(), cos, sin) is None
    assert rope._compiled_rotary(torch.randn(4, 16, 2).transpose(1, 2), cos, sin) is None  # heads not contiguous


@pytest.mark.parametrize("width", [1536, 40, 7])  # whole vectors, a tail, only a tail
@torch.inference_mode()
def test_swiglu_equals_silu_gate_times_up(width: int) -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(9, 2 * width, generator=g) * 6
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])[: min(3, width)]  # e^-|g| underflows; zero
    got = swiglu(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = (F.silu(gate) * up).float()
    assert got is not None and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@torch.inference_mode()
def test_swiglu_rows_do_not_depend_on_their_neighbours() -> None:
    gate_up = torch.randn(300, 2 * 1536)
    whole = swiglu(gate_up)
    alone = swiglu(gate_up[123:124])
    assert whole is not None and alone is not None and torch.equal(whole[123:124], alone)


def test_swiglu_declines_autograd_and_other_dtypes() -> None:
    with torch.enable_grad():
        assert swiglu(torch.randn(2, 8, requires_grad=True)) is None
    with torch.inference_mode():
        assert swiglu(torch.randn(2, 8).bfloat16()) is None
