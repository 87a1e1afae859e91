"""engine_ext.kernels.quant and compiled: the compiled Q4_1/Q8_0 products equal
`x @ dequantize().T` (AVX-512F and AVX2 builds), a row's result is bitwise the same alone,
in any batch and on any number of threads, requantizing GGUF-style blocks gives them back
exactly, and the build fails in one line when it cannot compile."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_ext.kernels import compiled
from engine_ext.kernels.quant import BLOCK, Q4_1, Q8_0, QuantWeight
from engine_ext.kernels.compiled import ISA_ENV, KernelBuildError, NoCompilerError, kernels, load_library

ISAS = ("avx512", "avx2")
_CAPABILITY = torch.backends.cpu.get_cpu_capability()
_CPU_HAS = {"avx512": _CAPABILITY == "AVX512", "avx2": _CAPABILITY in ("AVX2", "AVX512")}
_KQ_ISA = {"avx512": 2, "avx2": 1}  # what the library's kq_isa() reports for each build
SHAPES = [(40, 64), (72, 96)]  # (N, K): N not a multiple of the kernel's 16 columns per task


@pytest.fixture(autouse=True)
def _default_library(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts and ends with no cached library: one that forces an instruction
    set (or none) leaves the default one to whatever loads next."""
    load_library.cache_clear()
    kernels.cache_clear()
    yield
    load_library.cache_clear()
    kernels.cache_clear()


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The library built for one instruction set (KVRELAY_KERNEL_ISA), checked to be that build."""
    name: str = request.param
    if not _CPU_HAS[name]:
        pytest.skip(f"this CPU has no {name} (torch reports {_CAPABILITY})")
    monkeypatch.setenv(ISA_ENV, name)
    load_library.cache_clear()
    kernels.cache_clear()
    lib = load_library()
    assert lib is not None and lib.kq_isa() == _KQ_ISA[name]
    return name


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_q4_1(n: int, k: int, seed: int) -> Q4_1:
    """Arbitrary stored blocks (any bytes, signed fp32 scales and minimums)."""
    gen = _gen(seed)
    packed = torch.randint(0, 256, (n, k // BLOCK, 16), generator=gen, dtype=torch.uint8)
    return Q4_1(packed, torch.randn(n, k // BLOCK, generator=gen), torch.randn(n, k // BLOCK, generator=gen))


def random_q8_0(n: int, k: int, seed: int) -> Q8_0:
    gen = _gen(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return Q8_0(q, torch.randn(n, k // BLOCK, generator=gen))


def _with_extremes(codes: torch.Tensor, low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """Puts code `low` and code `high` at random distinct places of every block (N, K/32, 32),
    as a GGUF quantizer's blocks have them (their minimum and maximum)."""
    places = torch.rand(codes.shape, generator=gen).argsort(-1)[..., :2]
    return codes.scatter(-1, places, torch.tensor([low, high]).expand(*codes.shape[:-1], 2).contiguous())


def exact_q4_1(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense weight every block of which is d*q + m (fp32: product rounded, then sum) for
    integer codes 0..15 that include 0 and 15, with d and m fp16 values as GGUF stores them.
    Returns (weight (N, K), codes (N, K/32, 32), d, m)."""
    gen = _gen(seed)
    codes = _with_extremes(torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=gen), 0, 15, gen)
    d = (torch.rand(n, k // BLOCK, generator=gen) * 0.05 + 1e-3).half().float()
    m = (torch.randn(n, k // BLOCK, generator=gen) * 0.2).half().float()
    weight = codes.float() * d[..., None]
    weight = weight + m[..., None]
    return weight.reshape(n, k), codes, d, m


def exact_q8_0(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense weight whose blocks are d*q for codes -127..127 including -127 or 127 (a Q8_0
    block's largest magnitude), d an fp16 value. Returns (weight (N, K), codes (N, K/32, 32), d)."""
    gen = _gen(seed)
    codes = torch.randint(-127, 128, (n, k // BLOCK, BLOCK), generator=gen)
    codes = _with_extremes(codes, -127, 127, gen) if seed % 2 else _with_extremes(codes, 127, 5, gen)
    d = (torch.rand(n, k // BLOCK, generator=gen) * 0.01 + 1e-4).half().float()
    return (codes.float() * d[..., None]).reshape(n, k), codes, d


def _assert_product(quant: QuantWeight, x: torch.Tensor, y: torch.Tensor) -> None:
    """y is x @ dequantize().T up to fp32 rounding of its sums: within 1e-5 of sum |x||w|."""
    w = quant.dequantize().double()
    reference = x.double() @ w.T
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-30
    error = (y.double() - reference).abs()
    assert y.shape == reference.shape and y.dtype == torch.float32
    assert bool((error <= bound).all()), f"worst error / bound {float((error / bound).max()):.3g}"


# -- the stored layouts ----------------------------------------------------------------------

def test_dequantize_reads_the_gguf_layouts_value_by_value() -> None:
    """Q4_1: byte j of a block holds element j (low nibble) and j + 16 (high), w = d*q + m;
    Q8_0: w = d*q. Checked one scalar at a time against dequantize()."""
    q4, q8 = random_q4_1(3, 64, seed=1), random_q8_0(3, 64, seed=2)
    w4, w8 = q4.dequantize(), q8.dequantize()
    assert w4.shape == w8.shape == (3, 64) and q4.shape == q8.shape == (3, 64)
    for n in range(3):
        for col in range(64):
            b, j = divmod(col, BLOCK)
            byte = int(q4.packed[n, b, j % 16])
            code = byte & 0x0F if j < 16 else byte >> 4
            d, m = q4.d[n, b : b + 1], q4.m[n, b : b + 1]  # fp32 (1,) tensors: fp32 rounding
            assert torch.equal(w4[n, col : col + 1], torch.tensor([float(code)]) * d + m)
            assert torch.equal(w8[n, col : col + 1], q8.q[n, col : col + 1].float() * q8.d[n, b : b + 1])


# -- the compiled products -------------------------------------------------------------------

@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_kernel_computes_x_times_the_dequantized_weight(isa: str, fmt: str, n: int, k: int) -> None:
    """Rows 1..20: one partial 8-row tile, full tiles, and full tiles plus a remainder."""
    quant = random_q4_1(n, k, seed=3) if fmt == "q4_1" else random_q8_0(n, k, seed=3)
    x = torch.randn(20, k, generator=_gen(4))
    for rows in range(1, 21):
        _assert_product(quant, x[:rows], quant.linear(x[:rows], 2))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_requantized_weights_and_constant_blocks_multiply_as_dequantized(isa: str, fmt: str) -> None:
    """Weights through quantize() (including constant blocks, d == 0) and a non-contiguous x."""
    weight = torch.randn(40, 96, generator=_gen(5))
    weight[3, :32] = 0.25  # Q4_1: d == 0, m == 0.25
    weight[7, 32:64] = 0.0  # Q8_0 (and Q4_1): d == 0
    quant: QuantWeight = Q4_1.quantize(weight) if fmt == "q4_1" else Q8_0.quantize(weight)
    x_t = torch.randn(96, 11, generator=_gen(6)).T  # (11, 96), not contiguous
    y = quant.linear(x_t, 2)
    _assert_product(quant, x_t, y)
    assert torch.equal(y, quant.linear(x_t.contiguous(), 2))


def test_q4_1_blocks_whose_minimum_cancels_their_codes_stay_within_rounding(isa: str) -> None:
    """The AVX2 kernel applies a block's minimum to the sum of x (d*sum(q*x) + m*sum(x)):
    the two terms cancel when the weights sit near zero (m = -7.5 d, codes 7 and 8, so
    |w| = d/2) and x has a large mean. The error must stay at fp32 rounding of the sums."""
    gen = _gen(11)
    n, k = 48, 1536
    codes = torch.randint(7, 9, (n, k // BLOCK, BLOCK), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // BLOCK, generator=gen) + 0.5) * 0.01
    quant = Q4_1((codes[..., :16] | (codes[..., 16:] << 4)).contiguous(), d, -7.5 * d)
    x = 4.0 + 0.1 * torch.randn(9, k, generator=_gen(12))
    for rows in (1, 9):
        _assert_product(quant, x[:rows], quant.linear(x[:rows], 2))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_row_s_result_is_bitwise_the_same_alone_in_any_batch_and_on_any_threads(isa: str, fmt: str) -> None:
    quant = random_q4_1(72, 96, seed=7) if fmt == "q4_1" else random_q8_0(72, 96, seed=7)
    row = torch.randn(1, 96, generator=_gen(8))
    alone = quant.linear(row, 1)
    assert torch.equal(alone, quant.linear(row, 2))
    others = torch.randn(20, 96, generator=_gen(9))
    for size in (2, 7, 8, 9, 16, 17, 20):
        for position in sorted({0, size // 2, 7 % size, 8 % size, size - 1}):
            batch = others[:size].clone()
            batch[position] = row[0]
            for threads in (1, 2):
                y = quant.linear(batch, threads)
                assert torch.equal(y[position], alone[0]), (size, position, threads)
                if position == 0:
                    assert torch.equal(y, quant.linear(batch, 3 - threads))


def test_zero_rows_give_an_empty_product(isa: str) -> None:
    quant = random_q4_1(40, 64, seed=10)
    assert quant.linear(torch.empty(0, 64), 2).shape == (0, 40)


# -- quantize, lossless, nbytes --------------------------------------------------------------

@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_q4_1_blocks_stored_exactly_quantize_back_to_the_same_blocks(n: int, k: int) -> None:
    weight, codes, d, m = exact_q4_1(n, k, seed=11)
    quant = Q4_1.quantize(weight)
    expected_packed = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8)
    assert torch.equal(quant.packed, expected_packed)
    assert torch.equal(quant.d, d) and torch.equal(quant.m, m)
    assert quant.lossless(weight) and torch.equal(quant.dequantize(), weight)
    nudged = weight.clone()
    nudged[n - 1, k - 1] = torch.nextafter(nudged[n - 1, k - 1], torch.tensor(float("inf")))
    assert not quant.lossless(nudged) and not Q4_1.quantize(nudged).lossless(nudged)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("seed", [12, 13])  # blocks with both -127 and 127; with 127 alone
def test_q8_0_blocks_stored_exactly_quantize_back_to_the_same_blocks(n: int, k: int, seed: int) -> None:
    weight, codes, d = exact_q8_0(n, k, seed=seed)
    quant = Q8_0.quantize(weight)
    assert torch.equal(quant.q, codes.reshape(n, k).to(torch.int8)) and torch.equal(quant.d, d)
    assert quant.lossless(weight) and torch.equal(quant.dequantize(), weight)
    nudged = weight.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(float("inf")))
    assert not quant.lossless(nudged)


@pytest.mark.parametrize("cls", [Q4_1, Q8_0])
def test_gaussian_weights_are_not_lossless(cls: type[QuantWeight]) -> None:
    weight = torch.randn(40, 64, generator=_gen(14))
    quant = cls.quantize(weight)
    assert not quant.lossless(weight)
    error = (quant.dequantize() - weight).abs().max()
    assert 0 < float(error) < (0.5 if cls is Q4_1 else 0.05)  # within half a step of a block's scale


def test_constant_blocks_quantize_without_nan_and_dequantize_exactly() -> None:
    weight = torch.tensor([0.37, -1.5, 0.0, -0.0]).repeat_interleave(BLOCK).reshape(2, 64)
    q4 = Q4_1.quantize(weight)
    assert torch.equal(q4.d, torch.zeros(2, 2)) and torch.equal(q4.m, torch.tensor([[0.37, -1.5], [0.0, 0.0]]))
    assert torch.equal(q4.dequantize(), weight) and q4.lossless(weight)
    zeros = torch.zeros(3, 64)
    zeros[1, 32:] = -0.0
    q8 = Q8_0.quantize(zeros)
    assert torch.equal(q8.d, torch.zeros(3, 2)) and not bool(q8.q.any())
    assert torch.equal(q8.dequantize(), zeros) and q8.lossless(zeros)
    for quant in (q4, q8):
        assert not bool(quant.dequantize().isnan().any())


@pytest.mark.parametrize("cls", [Q4_1, Q8_0])
@pytest.mark.parametrize("k", [40, 16, 48])
def test_rows_not_a_multiple_of_32_are_refused(cls: type[QuantWeight], k: int) -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        cls.quantize(torch.randn(4, k))


@pytest.mark.parametrize("cls", [Q4_1, Q8_0])
@pytest.mark.parametrize("x", [torch.randn(2, 64, dtype=torch.float64), torch.randn(2, 64).bfloat16(),
                               torch.randn(1, 2, 64), torch.randn(64)], ids=["fp64", "bf16", "3-D", "1-D"])
def test_linear_refuses_anything_but_2d_fp32_rows(cls: type[QuantWeight], x: torch.Tensor) -> None:
    quant = cls.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="2-D fp32 rows"):
        quant.linear(x, 1)


@pytest.mark.parametrize(("n", "k"), [(40, 64), (72, 96), (1, 32)])
def test_nbytes_is_what_the_stored_tensors_occupy(n: int, k: int) -> None:
    weight = torch.randn(n, k)
    assert Q4_1.quantize(weight).nbytes == n * k // 2 + 2 * 4 * n * k // 32
    assert Q8_0.quantize(weight).nbytes == n * k + 4 * n * k // 32


# -- building and loading --------------------------------------------------------------------

def test_isa_none_gives_no_library_and_products_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_ENV, "none")
    assert compiled.cpu_isa() is None and load_library() is None
    with pytest.raises(RuntimeError, match="no quantized-product kernel"):
        Q4_1.quantize(torch.randn(8, 64)).linear(torch.randn(1, 64), 1)


@pytest.mark.parametrize("value", ["avx512f", "AVX2", "sse"])
def test_an_unknown_isa_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ISA_ENV, value)
    with pytest.raises(KernelBuildError, match=ISA_ENV):
        load_library()


def _fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and "\n" not in message
    return message


def test_a_compiler_that_cannot_run_is_a_build_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = _fresh_cache(monkeypatch, tmp_path)
    missing = tmp_path / "no-such-g++"
    monkeypatch.setenv("CXX", str(missing))
    with pytest.raises(KernelBuildError) as caught:
        compiled.build("avx2")
    assert str(missing) in _one_line(caught.value)
    assert not list(cache.rglob("*.so"))


def test_no_compiler_at_all_is_a_no_compiler_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fresh_cache(monkeypatch, tmp_path)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)  # the module build() reads
    with pytest.raises(NoCompilerError) as caught:
        compiled.build("avx2")
    assert "g++" in _one_line(caught.value)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to compile with")
def test_a_source_that_does_not_compile_is_a_one_line_build_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = _fresh_cache(monkeypatch, tmp_path)
    broken = tmp_path / "broken_linear.cpp"
    broken.write_text('extern "C" int kq_isa() { return 1 }\nint f( {\n')
    monkeypatch.setattr(compiled, "SOURCES", (broken,))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(KernelBuildError) as caught:
        compiled.build("avx2")
    assert type(caught.value) is KernelBuildError  # a broken build, not a missing compiler
    assert "failed" in _one_line(caught.value)
    assert not list(cache.rglob("*.so")) and not any(p.is_dir() for p in (cache / "kernels").iterdir())
    monkeypatch.setenv(ISA_ENV, "avx2")
    with pytest.raises(KernelBuildError):
        load_library()


@pytest.mark.slow
def test_a_fresh_cache_builds_the_library_from_source_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What `make install` does on a fresh machine: g++ builds the library into the cache,
    named by instruction set and source hash; a second build finds it and compiles nothing."""
    isa = compiled.cpu_isa()
    if isa is None or shutil.which("g++") is None:
        pytest.skip("no instruction set or no g++ to build with")
    cache = _fresh_cache(monkeypatch, tmp_path)
    built = compiled.build(isa)
    assert built.is_file() and built.is_relative_to(cache) and isa in built.name
    stamp = built.stat().st_mtime_ns
    assert compiled.build(isa) == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no scratch left behind
