"""Build and load quant_linear.cpp, the weight-only quantized products decode runs on.

The library is plain C++ with a C ABI, loaded with ctypes: it needs g++ and nothing a
fresh machine lacks (no torch headers, no ninja), and builds in about two seconds.
`make install` builds it (`python -m engine_ext.kernels.quant_build`); a first load builds it
if that did not happen. It is compiled for the widest instruction set this CPU has that
the source supports (AVX-512F, else AVX2 + FMA); on other CPUs there is no library and
the engine multiplies by the same weight values through its dense path.

The build lands in the user's cache directory, named by instruction set and a hash of
the source and flags, so an edited source or another CPU never loads a stale build; it
is written to a temporary name and renamed, so concurrent first loads cannot read half a
file. It links OpenMP with -fopenmp: the library then shares the libgomp torch has
already loaded (same soname), so its threads are torch's, not a second pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Literal

import torch

from engine_ext.errors import EngineError
from engine_ext.model_store import cache_dir

Isa = Literal["avx512", "avx2"]

SOURCE = Path(__file__).with_name("quant_linear.cpp")
_ISA_FLAGS: dict[Isa, tuple[str, ...]] = {
    "avx512": ("-mavx512f", "-mfma"),
    "avx2": ("-mavx2", "-mfma"),
}
# -ffp-contract=off: a weight is d*q rounded, then + m rounded, as torch computes it.
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
# torch's names for the capabilities that include each instruction set.
_TORCH_CAPABILITY: dict[str, Isa] = {"AVX512": "avx512", "AVX2": "avx2"}
# Set to "avx2" to build the narrower kernel on a wider CPU, or "none" to have no kernel.
ISA_ENV = "KVRELAY_KERNEL_ISA"


class KernelBuildError(EngineError):
    """The quantized-product library could not be compiled or loaded."""


class NoCompilerError(KernelBuildError):
    """No C++ compiler to build the library with."""


def cpu_isa() -> Isa | None:
    """The instruction set to build for: $KVRELAY_KERNEL_ISA, else what this CPU has."""
    forced = os.environ.get(ISA_ENV)
    if forced == "none":
        return None
    for isa in _ISA_FLAGS:
        if forced == isa:
            return isa
    if forced:
        raise KernelBuildError(f"{ISA_ENV}={forced!r}: expected one of avx512, avx2, none")
    return _TORCH_CAPABILITY.get(torch.backends.cpu.get_cpu_capability())


def library_path(isa: Isa) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_FLAGS + _ISA_FLAGS[isa]).encode())
    return cache_dir() / "kernels" / f"quant_linear-{isa}-{digest.hexdigest()[:12]}.so"


def build(isa: Isa) -> Path:
    """Compile the library for `isa` unless a build of this source is already cached."""
    target = library_path(isa)
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++")
    if compiler is None:
        raise NoCompilerError("no C++ compiler: install g++ (or set CXX) to build the int4 kernel")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        scratch = Path(tmp) / target.name
        cmd = [compiler, *_FLAGS, *_ISA_FLAGS[isa], str(SOURCE), "-o", str(scratch)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-3:]
            raise KernelBuildError(f"building {SOURCE.name} failed: {' | '.join(tail)}")
        os.replace(scratch, target)
    return target


@cache
def load_library() -> ctypes.CDLL | None:
    """The built library with its functions typed, or None where this CPU has no kernel."""
    isa = cpu_isa()
    if isa is None:
        return None
    try:
        lib = ctypes.CDLL(str(build(isa)))
    except OSError as exc:
        raise KernelBuildError(f"loading {SOURCE.name}: {exc}") from exc
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.kq_isa.restype = i32
    lib.kq_q4_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i32]
    lib.kq_q4_linear.restype = None
    lib.kq_q8_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i32]
    lib.kq_q8_linear.restype = None
    return lib


def main() -> int:
    """`python -m engine_ext.kernels.quant_build`: build for this CPU (make install runs it)."""
    isa = cpu_isa()
    if isa is None:
        print("quant_linear: this CPU has neither AVX-512F nor AVX2; the engine uses dense weights")
        return 0
    try:
        print(f"quant_linear ({isa}): {build(isa)}")
    except NoCompilerError as exc:  # the engine runs without it, on dense weights
        print(f"quant_linear: {exc}; the engine will use dense weights", file=sys.stderr)
    except KernelBuildError as exc:  # a broken build is a bug: fail the install
        print(f"quant_linear: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
