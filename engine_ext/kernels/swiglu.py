"""The SwiGLU gate in one pass on the compiled kernel (engine_ext/kernels/elementwise.cpp).

torch computes silu(gate) * up as a chunk, a silu and a product: at decode's few rows
each op costs more in dispatch than in arithmetic, and at prefill each one reads its
whole tensor again. `swiglu` returns None where the kernel does not apply (another
dtype, autograd, no kernel), and the caller then runs torch's ops.
"""

from __future__ import annotations

import torch

from engine_ext.kernels.compiled import kernels


def swiglu(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up (N, 2 * I), each row's gate then its up -> silu(gate) * up (N, I), or None."""
    if gate_up.dtype != torch.float32 or torch.is_grad_enabled() or gate_up.dim() != 2:
        return None
    lib = kernels()
    if lib is None:
        return None
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    lib.kq_swiglu(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out
