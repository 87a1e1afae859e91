"""PackedLinear: the same products as nn.Linear, each row independent of the others."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from engine_ext.model import linear
from engine_ext.model.linear import PackedLinear, onednn_available, onednn_packs, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
needs_bf16 = pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="this CPU has no oneDNN bf16 kernel (AVX512-BW/VL/DQ or AVX-NE-CONVERT)"
)


def _layer(dtype: torch.dtype, bias: bool = False) -> PackedLinear:
    torch.manual_seed(0)
    layer = PackedLinear(576, 960, bias=bias).to(dtype)
    layer.pack()
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_f_linear(dtype, bias):
    layer = _layer(dtype, bias)
    x = torch.randn(37, 576).to(dtype)
    expected = nn.functional.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x).float(), expected, atol=tolerance, rtol=tolerance)


@needs_bf16
def test_a_row_s_result_does_not_depend_on_the_batch_beyond_f_linear_s_rounding():
    """fp32: a row alone, among 8 and among 300 agrees with F.linear's own spread; bf16:
    the same bits whatever the batch (what lets bf16 decode batched equal solo)."""
    layer = _layer(torch.float32)
    x = torch.randn(300, 576)
    reference = nn.functional.linear(x.double(), layer.weight.double()).float()
    for rows in (slice(0, 1), slice(0, 8), slice(0, 300)):
        torch.testing.assert_close(layer(x[rows]), reference[rows], atol=1e-5, rtol=1e-5)
    layer = _layer(torch.bfloat16)
    x = x.bfloat16()
    wide, eight = layer(x), layer(x[:8])
    for row in (0, 3, 7):
        alone = layer(x[row : row + 1])
        assert torch.equal(alone[0], eight[row]) and torch.equal(alone[0], wide[row])


def test_unpacked_it_is_nn_linear_and_pack_linears_packs_each_layer():
    model = nn.Sequential(PackedLinear(16, 8), nn.ReLU(), PackedLinear(8, 4, bias=False), nn.Linear(4, 2))
    x = torch.randn(3, 16)
    plain = model(x)
    assert all(m.packed is None for m in model if isinstance(m, PackedLinear))
    assert pack_linears(model, "packed") == 2
    torch.testing.assert_close(model(x), plain, atol=1e-6, rtol=1e-5)
    model[0].weight.data.mul_(2.0)  # a changed weight counts once packed again
    model[0].pack()
    assert not torch.allclose(model(x), plain)


def _slowed(op):
    """`op`, taking a millisecond longer per call: a kernel the timing must find slower."""
    def slow(*args, **kwargs):
        time.sleep(1e-3)
        return op(*args, **kwargs)
    return slow


@pytest.mark.parametrize("slow_side", ["packed", "plain"])
def test_auto_keeps_the_kernel_a_timing_finds_faster_for_fp32(monkeypatch, slow_side):
    model = nn.Sequential(PackedLinear(64, 96), PackedLinear(96, 64, bias=False))
    x = torch.randn(3, 64)
    plain = model(x)
    if slow_side == "packed":
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", _slowed(torch.ops.mkldnn._linear_pointwise))
    else:
        monkeypatch.setattr(nn.functional, "linear", _slowed(nn.functional.linear))
    packed = pack_linears(model, "auto")
    assert packed == (0 if slow_side == "packed" else 2)
    assert all((m.packed is None) == (slow_side == "packed") for m in model)
    torch.testing.assert_close(model(x), plain, atol=1e-6, rtol=1e-5)


@needs_bf16
def test_auto_packs_bf16_without_timing_and_plain_packs_nothing(monkeypatch):
    def no_timing(layers):
        raise AssertionError("bf16 is packed for its batch-independent rows, not timed")
    monkeypatch.setattr("engine_ext.model.linear._packed_is_faster", no_timing)
    model = nn.Sequential(PackedLinear(64, 96), PackedLinear(96, 64)).to(torch.bfloat16)
    assert pack_linears(model, "plain") == 0 and all(m.packed is None for m in model)
    assert pack_linears(model, "auto") == 2 and all(m.packed is not None for m in model)


def test_a_dtype_this_cpu_cannot_pack_stays_on_f_linear(monkeypatch):
    """Where oneDNN has no kernel for the dtype (bf16 on an AVX2-only CPU), every kernel
    choice leaves the layers unpacked and their products are F.linear's."""
    def no_kernel(weight, hint):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_kernel)
    monkeypatch.setattr(linear, "onednn_packs", linear.onednn_packs.__wrapped__)
    model = nn.Sequential(PackedLinear(64, 96), PackedLinear(96, 64)).to(torch.bfloat16)
    x = torch.randn(5, 64).bfloat16()
    for kernel in ("auto", "packed", "plain"):
        assert pack_linears(model, kernel) == 0 and all(m.packed is None for m in model)
    torch.testing.assert_close(model(x), nn.functional.linear(nn.functional.linear(x, model[0].weight, model[0].bias),
                                                             model[1].weight, model[1].bias))


@needs_bf16
def test_a_bf16_engine_packs_its_linears_and_decodes_a_batch_as_each_alone(llama_dir):
    from engine_ext.request import EngineRequest
    from engine_ext.sampling import SamplingParams
    from tests.helpers import make_engine

    engine = make_engine(llama_dir, num_blocks=64, dtype="bfloat16")
    layer = engine.model.layers[0]
    assert all(m.packed is not None for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj, engine.model.lm_head))
    assert make_engine(llama_dir, num_blocks=8, linear_kernel="plain").model.lm_head.packed is None
    assert make_engine(llama_dir, num_blocks=8, linear_kernel="packed").model.lm_head.packed is not None
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 17, 30)]
    alone = []
    for ids in prompts:
        engine.kv.pool.reset_cache()
        alone.append(engine.generate(ids, params).output_token_ids)
    engine.kv.pool.reset_cache()
    seqs = [engine.add_request(EngineRequest(f"b{i}", ids, params)) for i, ids in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    assert [s.output_token_ids for s in seqs] == alone
