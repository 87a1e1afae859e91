"""Weight-only quantized weights (GGUF's Q4_1 and Q8_0 blocks) and their decode product.

A `QuantWeight` holds one (N, K) weight as blocks of 32 along K and multiplies fp32 rows
by it with the compiled kernel (engine_ext/kernels/quant_linear.cpp). `dequantize()`
returns the dense weight with the very values the kernel multiplies: the engine prefills
with that copy, so prefill and decode compute with one set of weights.

`quantize(w)` requantizes a dense weight. For weights that were dequantized from these
formats (the default model ships as a Q4_1 GGUF with a Q8_0 output matrix), this gives
back the stored blocks exactly: `lossless(w)` checks that, value for value.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine_ext.kernels.compiled import kernels

BLOCK = 32


class QuantWeight(ABC):
    """One (N, K) weight in blocks of 32 along K. Contract: `linear(x)` equals
    `x @ dequantize().T` up to fp32 rounding of its sums (their order, and on AVX2 a
    block's scale and minimum applied to its sums), and a row's result does not depend on
    the rows beside it (bitwise)."""

    @classmethod
    @abstractmethod
    def quantize(cls, weight: torch.Tensor) -> QuantWeight:
        """Requantize a dense fp32 (N, K) weight, K a multiple of 32."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The dense fp32 (N, K) weight the kernel multiplies by."""

    @abstractmethod
    def linear(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """(M, K) fp32 contiguous rows -> (M, N), on the compiled kernel."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes a product streams: the stored blocks and their scales."""

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int]:
        """(N, K)."""

    def lossless(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is exactly the values this quantization stores."""
        return torch.equal(self.dequantize(), weight)


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"a quantized weight needs rows of a multiple of {BLOCK} values, got {k}")
    return weight.detach().float().reshape(n, k // BLOCK, BLOCK)  # (N, K/32, 32)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"this quantized product takes 2-D fp32 rows of {k}, got {x.dtype} {tuple(x.shape)}")
    return x.contiguous()


def _library() -> ctypes.CDLL:
    lib = kernels()
    if lib is None:
        raise RuntimeError("no quantized-product kernel on this CPU (see engine_ext/kernels/compiled.py)")
    return lib


@dataclass(frozen=True)
class Q4_1(QuantWeight):
    """4-bit weights with a scale and a minimum per block: w = d*q + m, q in 0..15."""

    packed: torch.Tensor  # (N, K/32, 16) uint8: byte j = element j (low nibble), j + 16 (high)
    d: torch.Tensor  # (N, K/32) fp32
    m: torch.Tensor  # (N, K/32) fp32

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q4_1:
        blocks = _blocks(weight)  # (N, K/32, 32)
        lo, hi = blocks.amin(-1), blocks.amax(-1)  # (N, K/32)
        d = (hi - lo) / 15
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((blocks - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        return cls(packed.contiguous(), d.contiguous(), lo.contiguous())

    def dequantize(self) -> torch.Tensor:
        q = torch.cat([self.packed & 0x0F, self.packed >> 4], dim=-1).float()  # (N, K/32, 32)
        w = q * self.d[..., None]  # rounded product, then rounded sum: the kernel's values
        w = w + self.m[..., None]
        return w.reshape(self.shape)

    def linear(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        n, k = self.shape
        x = _rows(x, k)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        _library().kq_q4_linear(_ptr(x), x.shape[0], k, _ptr(self.packed), _ptr(self.d), _ptr(self.m),
                                n, _ptr(y), threads)
        return y

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.d, self.m))

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK


@dataclass(frozen=True)
class Q8_0(QuantWeight):
    """8-bit weights with a scale per block: w = d*q, q in -127..127."""

    q: torch.Tensor  # (N, K) int8
    d: torch.Tensor  # (N, K/32) fp32

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q8_0:
        blocks = _blocks(weight)  # (N, K/32, 32)
        d = blocks.abs().amax(-1) / 127  # (N, K/32)
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(blocks / safe[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.reshape(weight.shape).contiguous(), d.contiguous())

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        w = self.q.reshape(n, k // BLOCK, BLOCK).float() * self.d[..., None]
        return w.reshape(n, k)

    def linear(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        n, k = self.shape
        x = _rows(x, k)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        _library().kq_q8_linear(_ptr(x), x.shape[0], k, _ptr(self.q), _ptr(self.d), n, _ptr(y), threads)
        return y

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.d.numel() * self.d.element_size()

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]
