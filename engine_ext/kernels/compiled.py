"""Build and load the engine's compiled kernels: quant_linear.cpp (weight-only quantized
products), decode_attention.cpp (attention straight from the paged cache),
prefill_attention.cpp (causal flash attention of a prefill chunk), rms_norm.cpp (RMSNorm
in one pass), elementwise.cpp (rotary and SwiGLU in one pass each) and decode_forward.cpp
(a decode step's whole layer stack, calling the others).

The library is plain C++ with a C ABI, loaded with ctypes: it needs g++ and nothing a
fresh machine lacks (no torch headers, no ninja), and builds in a few seconds.
`make install` builds it (`python -m engine_ext.kernels.compiled`); a first load builds it
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
import logging
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

log = logging.getLogger(__name__)

Isa = Literal["avx512", "avx2"]

SOURCES = tuple(Path(__file__).with_name(name) for name in ("quant_linear.cpp", "decode_attention.cpp",
                                                          "prefill_attention.cpp", "rms_norm.cpp",
                                                          "elementwise.cpp", "decode_forward.cpp"))
HEADERS = (Path(__file__).with_name("lanes.h"), Path(__file__).with_name("vec.h"))  # included by the sources: part of the build's hash
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
    sources = b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(sources + " ".join(_FLAGS + _ISA_FLAGS[isa]).encode())
    return cache_dir() / "kernels" / f"decode_kernels-{isa}-{digest.hexdigest()[:12]}.so"


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
        cmd = [compiler, *_FLAGS, *_ISA_FLAGS[isa], *map(str, SOURCES), "-o", str(scratch)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:  # CXX names no runnable program
            raise KernelBuildError(f"running the C++ compiler {compiler}: {exc}") from exc
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            first_error = next((line for line in lines if "error" in line), lines[-1] if lines else "")
            raise KernelBuildError(f"building the decode kernels failed: {first_error.strip()}")
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
        raise KernelBuildError(f"loading the decode kernels: {exc}") from exc
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.kq_isa.restype = i32
    lib.kq_q4_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i32]
    lib.kq_q4_linear.restype = None
    lib.kq_q8_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i32]
    lib.kq_q8_linear.restype = None
    lib.kq_decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                                        ctypes.c_float, i32]
    lib.kq_decode_attention.restype = i32
    lib.kq_prefill_attention.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                         ctypes.c_float, i32]
    lib.kq_prefill_attention.restype = i32
    lib.kq_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, i32]
    lib.kq_rms_norm.restype = None
    lib.kq_rotary.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, i32]
    lib.kq_rotary.restype = None
    lib.kq_swiglu.argtypes = [ptr, ptr, i64, i64, i32]
    lib.kq_swiglu.restype = None
    lib.kq_decode_forward.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i32]
    lib.kq_decode_forward.restype = i32
    return lib


@cache
def kernels() -> ctypes.CDLL | None:
    """`load_library()`, or None where this CPU has no build or it fails: the failure is
    logged once and the engine keeps to torch's ops."""
    try:
        return load_library()
    except KernelBuildError as exc:
        log.warning("compiled decode kernels unavailable, using torch's ops: %s", exc)
        return None


def main() -> int:
    """`python -m engine_ext.kernels.compiled`: build for this CPU (make install runs it)."""
    isa = cpu_isa()
    if isa is None:
        print("decode kernels: this CPU has neither AVX-512F nor AVX2; the engine uses torch ops")
        return 0
    try:
        print(f"decode kernels ({isa}): {build(isa)}")
    except NoCompilerError as exc:  # the engine runs without it, on dense weights
        print(f"decode kernels: {exc}; the engine will use torch ops", file=sys.stderr)
    except KernelBuildError as exc:  # a broken build is a bug: fail the install
        print(f"decode kernels: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
