"""engine_ext.model.quantize and PackedLinear.quant: `auto` gives quantized copies only
where they store every layer's weights exactly (then no weight changes), `int4` quantizes
any fp32 model (its dense weights become the quantized values), and a layer's products of
up to QUANT_MAX_ROWS rows run on its quantized copy, longer ones on the dense weight."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_ext.config import EngineConfig
from engine_ext.kernels.quant import BLOCK, Q4_1, Q8_0, QuantWeight
from engine_ext.kernels.compiled import ISA_ENV, KernelBuildError, kernels, load_library
from engine_ext.model.linear import QUANT_MAX_ROWS, PackedLinear, onednn_available
from engine_ext.model.quantize import Quantized, quantize_linears
from kvrelay.engine_options import LinearKernel


@pytest.fixture(autouse=True)
def _default_library(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test loads the library its environment asks for, and leaves none cached."""
    load_library.cache_clear()
    kernels.cache_clear()
    yield
    load_library.cache_clear()
    kernels.cache_clear()


def _kernel_here() -> bool:
    """Whether the library loads; a broken build fails tests/engine_ext/kernels/test_quant.py."""
    try:
        available = load_library() is not None
    except KernelBuildError:
        available = False
    finally:
        load_library.cache_clear()
        kernels.cache_clear()
    return available


needs_kernel = pytest.mark.skipif(not _kernel_here(), reason="this CPU has no quantized-product kernel")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _exact_q4_1(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Blocks d*q + m (product rounded, then sum) with codes spanning 0..15 and fp16 d, m:
    what a Q4_1 GGUF dequantizes to."""
    codes = torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=gen)
    codes[..., 3], codes[..., 20] = 0, 15
    d = (torch.rand(n, k // BLOCK, generator=gen) * 0.05 + 1e-3).half().float()
    m = (torch.randn(n, k // BLOCK, generator=gen) * 0.2).half().float()
    weight = codes.float() * d[..., None]
    return (weight + m[..., None]).reshape(n, k)


def _exact_q8_0(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Blocks d*q with codes spanning -127..127 and an fp16 d: a Q8_0 output matrix."""
    codes = torch.randint(-127, 128, (n, k // BLOCK, BLOCK), generator=gen)
    codes[..., 5], codes[..., 30] = -127, 127
    d = (torch.rand(n, k // BLOCK, generator=gen) * 0.01 + 1e-4).half().float()
    return (codes.float() * d[..., None]).reshape(n, k)


class Tiny(nn.Module):
    """Three eligible layers (two Q4_1 projections, one nested; a Q8_0 lm_head), one whose
    rows (40) are no multiple of 32, and a plain nn.Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up = PackedLinear(64, 40, bias=True)
        self.odd = PackedLinear(40, 64)
        self.block = nn.Module()
        self.block.proj = PackedLinear(96, 72, bias=False)
        self.plain = nn.Linear(64, 64)
        self.lm_head = PackedLinear(64, 48, bias=False)

    def eligible(self) -> dict[str, PackedLinear]:
        proj = self.block.proj
        assert isinstance(proj, PackedLinear)
        return {"up": self.up, "block.proj": proj, "lm_head": self.lm_head}


def _tiny(exact: bool, seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny()
    if exact:
        gen = _gen(seed + 100)
        with torch.no_grad():
            for name, layer in model.eligible().items():
                n, k = layer.weight.shape
                layer.weight.copy_(_exact_q8_0(n, k, gen) if name == "lm_head" else _exact_q4_1(n, k, gen))
    return model


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def _quants(model: Tiny) -> dict[str, QuantWeight | None]:
    return {name: m.quant for name, m in model.named_modules() if isinstance(m, PackedLinear)}


@needs_kernel
def test_auto_quantizes_exactly_stored_weights_without_changing_any() -> None:
    model = _tiny(exact=True)
    before = _weights(model)
    done = quantize_linears(model, "auto")
    _assert_unchanged(model, before)
    quants = _quants(model)
    assert quants["odd"] is None
    assert isinstance(quants["up"], Q4_1) and isinstance(quants["block.proj"], Q4_1)
    assert isinstance(quants["lm_head"], Q8_0)
    for name, layer in model.eligible().items():
        quant = layer.quant
        assert quant is not None and quant.shape == tuple(layer.weight.shape)
        assert torch.equal(quant.dequantize(), layer.weight), name
    nbytes = sum(q.nbytes for q in quants.values() if q is not None)
    assert done == Quantized(layers=3, lossless=True, kernel=True, bytes=nbytes)
    assert nbytes == (40 * 64 + 72 * 96) // 2 + 2 * 4 * (40 * 64 + 72 * 96) // 32 + 48 * 64 + 4 * 48 * 64 // 32


@needs_kernel
@pytest.mark.parametrize("random_layer", [None, "lm_head", "block.proj"])
def test_auto_quantizes_nothing_unless_every_layer_is_stored_exactly(random_layer: str | None) -> None:
    model = _tiny(exact=random_layer is not None)
    if random_layer is not None:  # one layer that no block format stores exactly
        layer = model.eligible()[random_layer]
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=_gen(1)))
    before = _weights(model)
    done = quantize_linears(model, "auto")
    assert done == Quantized() and done.layers == 0
    assert all(q is None for q in _quants(model).values())
    _assert_unchanged(model, before)


@needs_kernel
def test_int4_quantizes_random_weights_and_they_become_the_quantized_values() -> None:
    model = _tiny(exact=False)
    before = _weights(model)
    expected = {name: (Q8_0 if name == "lm_head" else Q4_1).quantize(before[f"{name}.weight"]).dequantize()
                for name in model.eligible()}
    done = quantize_linears(model, "int4")
    assert done.layers == 3 and not done.lossless and done.kernel
    for name, layer in model.eligible().items():
        assert layer.quant is not None and torch.equal(layer.quant.dequantize(), layer.weight)
        assert torch.equal(layer.weight, expected[name]) and not torch.equal(layer.weight, before[f"{name}.weight"])
    assert model.odd.quant is None
    untouched = {k: v for k, v in before.items() if not any(k == f"{n}.weight" for n in model.eligible())}
    assert set(untouched) == {"up.bias", "odd.weight", "odd.bias", "plain.weight", "plain.bias"}
    _assert_unchanged(model, {**untouched, **{f"{n}.weight": w for n, w in expected.items()}})


@needs_kernel
def test_int4_on_exactly_stored_weights_is_lossless() -> None:
    model = _tiny(exact=True)
    before = _weights(model)
    done = quantize_linears(model, "int4")
    assert done.layers == 3 and done.lossless and done.kernel
    _assert_unchanged(model, before)


@pytest.mark.parametrize("kernel", ["packed", "plain"])
def test_packed_and_plain_quantize_nothing(kernel: LinearKernel) -> None:
    model = _tiny(exact=True)
    before = _weights(model)
    assert quantize_linears(model, kernel) == Quantized()
    assert all(q is None for q in _quants(model).values())
    _assert_unchanged(model, before)


@pytest.mark.parametrize("kernel", ["auto", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_non_fp32_model_is_left_alone(kernel: LinearKernel, dtype: torch.dtype) -> None:
    model = _tiny(exact=True).to(dtype)  # Q4_1 values with fp16 d, m survive bf16 only approximately
    before = _weights(model)
    assert quantize_linears(model, kernel) == Quantized()
    assert all(q is None for q in _quants(model).values())
    _assert_unchanged(model, before)


def test_without_a_kernel_auto_does_nothing_and_int4_decodes_on_the_quantized_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_ENV, "none")
    exact = _tiny(exact=True)
    before = _weights(exact)
    assert quantize_linears(exact, "auto") == Quantized()
    assert all(q is None for q in _quants(exact).values())
    _assert_unchanged(exact, before)

    model = _tiny(exact=False)
    before = _weights(model)
    done = quantize_linears(model, "int4")
    assert done.layers == 3 and not done.lossless and not done.kernel
    assert all(q is None for q in _quants(model).values())
    x = torch.randn(3, 64, generator=_gen(2))
    for name, layer in model.eligible().items():
        dequantized = (Q8_0 if name == "lm_head" else Q4_1).quantize(before[f"{name}.weight"]).dequantize()
        assert torch.equal(layer.weight, dequantized)
        bias = None if layer.bias is None else before[f"{name}.bias"]
        inputs = x if layer.in_features == 64 else torch.randn(3, layer.in_features, generator=_gen(3))
        assert torch.equal(layer(inputs), F.linear(inputs, dequantized, bias))


def test_a_failed_kernel_build_leaves_auto_on_the_dense_weights(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ISA_ENV, "sse")  # refused by the loader: no library, a warning
    model = _tiny(exact=True)
    before = _weights(model)
    with caplog.at_level(logging.WARNING, logger="engine_ext.kernels.compiled"):
        assert quantize_linears(model, "auto") == Quantized()
    assert any("kernels unavailable" in r.message for r in caplog.records)
    assert all(q is None for q in _quants(model).values())
    _assert_unchanged(model, before)


# -- PackedLinear's choice of product --------------------------------------------------------

def _layer_with_distinct_quant(bias: bool) -> PackedLinear:
    """A layer whose quantized copy stores *another* weight, so the two paths differ visibly."""
    torch.manual_seed(4)
    layer = PackedLinear(64, 40, bias=bias)
    layer.quant = Q4_1.quantize(torch.randn(40, 64, generator=_gen(5)))
    return layer


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.skipif(
    not onednn_available(), reason="this torch build has no oneDNN"))])
def test_few_rows_run_on_the_quantized_copy_and_more_on_the_dense_weight(bias: bool, packed: bool) -> None:
    layer = _layer_with_distinct_quant(bias)
    if packed:
        layer.pack()
    quant = layer.quant
    assert quant is not None
    x = torch.randn(QUANT_MAX_ROWS + 4, 64, generator=_gen(6))
    with torch.no_grad():
        for rows in (1, 8, QUANT_MAX_ROWS):
            expected = quant.linear(x[:rows], 1)
            if layer.bias is not None:
                expected = expected + layer.bias
                assert not torch.equal(expected, quant.linear(x[:rows], 1))
            y = layer(x[:rows])
            assert torch.equal(y, expected), rows
            assert not torch.allclose(y, F.linear(x[:rows], layer.weight, layer.bias), atol=1e-2)
        for rows in (QUANT_MAX_ROWS + 1, QUANT_MAX_ROWS + 4):
            y = layer(x[:rows])
            assert torch.equal(y, layer.dense(x[:rows])), rows
            torch.testing.assert_close(y, F.linear(x[:rows], layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
            assert not torch.allclose(y, quant.linear(x[:rows], 1), atol=1e-2)


@needs_kernel
def test_inputs_the_kernel_does_not_take_run_on_the_dense_weight() -> None:
    """3-D activations and a bf16 layer's rows never reach the fp32 kernel."""
    layer = _layer_with_distinct_quant(bias=True)
    x = torch.randn(1, 4, 64, generator=_gen(7))
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        half = layer.to(torch.bfloat16)
        xb = x[0].bfloat16()
        assert torch.equal(half(xb), half.dense(xb))


@needs_kernel
def test_an_exactly_stored_layer_gives_decode_and_prefill_the_same_products() -> None:
    """With the quantized copy storing the dense weight, the 16-row (kernel) and 17-row (dense)
    products differ only in the order of their sums."""
    layer = PackedLinear(96, 72, bias=True)
    with torch.no_grad():
        layer.weight.copy_(_exact_q4_1(72, 96, _gen(8)))
    model = nn.Sequential(layer)
    assert quantize_linears(model, "auto").layers == 1 and layer.quant is not None
    x = torch.randn(QUANT_MAX_ROWS + 1, 96, generator=_gen(9))
    with torch.no_grad():
        decode, prefill = layer(x[:QUANT_MAX_ROWS]), layer(x)
    torch.testing.assert_close(decode, prefill[:QUANT_MAX_ROWS], atol=1e-5, rtol=1e-5)


# -- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_engine_config_refuses_int4_without_fp32(dtype: str) -> None:
    with pytest.raises(ValueError, match="needs dtype float32"):
        EngineConfig(linear_kernel="int4", dtype=dtype)  # type: ignore[arg-type]


def test_the_engine_config_takes_int4_with_fp32() -> None:
    assert EngineConfig(linear_kernel="int4").linear_kernel == "int4"
    assert EngineConfig(linear_kernel="auto", dtype="bfloat16").linear_kernel == "auto"
