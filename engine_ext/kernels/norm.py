"""RMSNorm in one pass on the compiled kernel (engine_ext/kernels/rms_norm.cpp).

torch's fp32 `rms_norm` runs as several small ops on CPU; at decode's few rows their
overhead is most of a norm's time, and a step has two norms per layer. `rms_norm`
returns None where the kernel does not apply (another dtype, autograd, no kernel), and
the caller then runs torch's.
"""

from __future__ import annotations

import torch

from engine_ext.kernels.compiled import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x (..., dim) fp32, weight (dim,) -> x / sqrt(mean(x^2) + eps) * weight, or None."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or torch.is_grad_enabled():
        return None
    lib = kernels()
    if lib is None:
        return None
    x = x.contiguous()
    dim = x.shape[-1]
    out = torch.empty_like(x)
    lib.kq_rms_norm(x.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                    torch.get_num_threads())
    return out
