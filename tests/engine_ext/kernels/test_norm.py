"""engine_ext.kernels.norm: the one-pass RMSNorm equals torch's, gives a row the same bits
alone or among others, and declines what it does not compute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_ext.kernels.compiled import load_library
from engine_ext.kernels.norm import rms_norm

pytestmark = pytest.mark.skipif(load_library() is None, reason="no compiled kernel on this CPU")


@pytest.mark.parametrize("dim", [64, 576, 37])  # 37: not a multiple of the kernel's 16 lanes
@torch.inference_mode()
def test_equals_torchs_rms_norm(dim: int) -> None:
    x, w = torch.randn(3, 5, dim) * 4, torch.randn(dim)
    got = rms_norm(x, w, 1e-5)
    assert got is not None and got.shape == x.shape
    torch.testing.assert_close(got, F.rms_norm(x, (dim,), w, 1e-5), rtol=2e-6, atol=2e-6)


@torch.inference_mode()
def test_a_row_gets_the_same_bits_alone_and_among_many() -> None:
    x, w = torch.randn(40, 96), torch.randn(96)  # 40 rows: the kernel splits rows over threads
    many = rms_norm(x, w, 1e-6)
    assert many is not None
    for r in (0, 17, 39):
        alone = rms_norm(x[r : r + 1], w, 1e-6)
        assert alone is not None and torch.equal(alone[0], many[r])


def test_declines_bf16_and_autograd() -> None:
    x, w = torch.randn(2, 32), torch.randn(32)
    with torch.inference_mode():
        assert rms_norm(x.bfloat16(), w.bfloat16(), 1e-6) is None
    with torch.enable_grad():
        assert rms_norm(x.requires_grad_(), w, 1e-6) is None
