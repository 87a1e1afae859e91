"""The compiled decode forward (engine_ext/model/decode_forward.py): which models and steps it
takes, and that a step through it is bitwise the module path's (hidden states and the K/V it
writes), alone and batched, for both instruction-set builds."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine
from engine_ext.errors import EngineError
from engine_ext.kernels.compiled import ISA_ENV, load_library, kernels
from engine_ext.model import AttentionMetadata, CausalLM
from engine_ext.model.decode_forward import CompiledDecode
from engine_ext.request import EngineRequest
from engine_ext.sampling import SamplingParams
from kvrelay.engine_options import LinearKernel
from tests.helpers import make_engine

_CAPABILITY = torch.backends.cpu.get_cpu_capability()
_CPU_HAS = {"avx512": _CAPABILITY == "AVX512", "avx2": _CAPABILITY in ("AVX2", "AVX512")}


@pytest.fixture(autouse=True)
def _default_library() -> Iterator[None]:
    load_library.cache_clear()
    kernels.cache_clear()
    yield
    load_library.cache_clear()
    kernels.cache_clear()


@pytest.fixture(params=("avx512", "avx2"))
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name: str = request.param
    if not _CPU_HAS[name]:
        pytest.skip(f"this CPU has no {name} (torch reports {_CAPABILITY})")
    monkeypatch.setenv(ISA_ENV, name)
    return name


Step = tuple[torch.Tensor, list[torch.Tensor]]  # hidden states, then every cache tensor after the step


def _both_paths(model: CausalLM, seen: list[int]) -> Callable[..., torch.Tensor]:
    """Wrap model.forward: a step the compiled path takes runs the module path too, on the
    same inputs and caches, and must match it bit for bit; `seen` counts such steps' rows."""
    forward = model.forward
    compiled = model.compiled_decode
    assert compiled is not None

    def run(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Any], meta: AttentionMetadata,
            adapters: Any = None, interrupt: Any = None) -> torch.Tensor:
        def once(path: CompiledDecode | None) -> Step:
            model.compiled_decode = path
            hidden = forward(input_ids, positions, kv_caches, meta, adapters, interrupt)
            return hidden, [t.clone() for cache in kv_caches for t in cache]

        if adapters is not None or not compiled.applies(input_ids.shape[0], meta):
            return forward(input_ids, positions, kv_caches, meta, adapters, interrupt)
        before = [t.clone() for cache in kv_caches for t in cache]
        fast = once(compiled)
        for t, saved in zip((t for cache in kv_caches for t in cache), before):
            t.copy_(saved)  # the module path starts from the same caches
        slow = once(None)
        model.compiled_decode = compiled
        assert torch.equal(fast[0], slow[0])
        assert all(torch.equal(a, b) for a, b in zip(fast[1], slow[1]))
        assert any(not torch.equal(a, b) for a, b in zip(fast[1], before)), "the step wrote no K/V"
        seen.append(input_ids.shape[0])
        return fast[0]

    return run


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(EngineRequest(f"r{uuid.uuid4().hex}", p, sampling, publish=False)) for p in prompts]
    while engine.has_work:
        engine.step()
    return [list(s.output_token_ids) for s in seqs]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a bias on the qkv projection
def test_a_decode_step_is_bitwise_the_module_path_alone_and_batched(
        isa: str, kind: str, tiny_model_dir: Callable[..., Path]) -> None:
    engine = make_engine(tiny_model_dir(kind), num_blocks=32, linear_kernel="int4")
    model = engine.model
    assert model.compiled_decode is not None
    seen: list[int] = []
    model.forward = _both_paths(model, seen)  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]
    batched = _generate(engine, prompts, 12)
    alone = [_generate(engine, [p], 12)[0] for p in prompts]
    assert batched == alone
    assert 1 in seen and 4 in seen  # steps of one row and of the whole batch ran both paths


def test_the_engine_decodes_the_same_tokens_with_and_without_it(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, num_blocks=32, linear_kernel="int4")
    compiled = engine.model.compiled_decode
    assert compiled is not None
    prompts = [[7, 8, 9, 10], list(range(20, 53))]
    with_it = _generate(engine, prompts, 16)
    engine.model.compiled_decode = None
    assert _generate(engine, prompts, 16) == with_it


@pytest.mark.parametrize(("kind", "kernel", "overrides"), [
    ("llama", "packed", {}),  # no quantized copies: the modules
    ("llama", "plain", {}),
    ("qwen3", "int4", {}),  # q/k norms: the modules
    ("llama", "int4", {"head_dim": 24, "hidden_size": 96}),  # a head size the attention kernel declines
])
def test_models_it_does_not_take_keep_the_module_path(kind: str, kernel: LinearKernel, overrides: dict[str, int],
                                                      tiny_model_dir: Callable[..., Path]) -> None:
    engine = LLMEngine(tiny_model_dir(kind, **overrides), EngineConfig(kv_cache_bytes=2**22, linear_kernel=kernel))
    assert engine.model.compiled_decode is None


def test_no_library_means_no_compiled_decode(monkeypatch: pytest.MonkeyPatch, llama_dir: Path) -> None:
    monkeypatch.setenv(ISA_ENV, "none")
    engine = make_engine(llama_dir, num_blocks=32, linear_kernel="int4")
    assert engine.model.compiled_decode is None
    assert _generate(engine, [[5, 6, 7]], 4)  # int4 decodes on the dense quantized values


def test_only_plain_decode_batches_apply() -> None:
    slots = torch.arange(8)
    decode = AttentionMetadata.build(slots[:2], [], [slots[:3], slots[3:5]])
    assert CompiledDecode.applies(2, decode)
    mixed = AttentionMetadata.build(slots[:4], [(3, slots[:3])], [slots[3:5]])
    assert not CompiledDecode.applies(4, mixed)  # a prefill chunk in the step
    prefill = AttentionMetadata.build(slots[:3], [(3, slots[:3])], [])
    assert not CompiledDecode.applies(3, prefill)
    with_decoders = AttentionMetadata.build(slots[:2], [], [slots[:3], slots[3:5]], [0])
    assert not CompiledDecode.applies(3, with_decoders)  # an ICaRus decoder query rides along
    many = AttentionMetadata.build(torch.arange(17), [], [torch.arange(i, i + 1) for i in range(17)])
    assert not CompiledDecode.applies(17, many)  # more rows than the quantized products take


def _decode_inputs(engine: LLMEngine, slot: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One decode row at position 3 over cache slots 0-3, writing its K/V to `slot`."""
    context = torch.tensor([0, 1, 2, slot])
    meta = AttentionMetadata.build(context[-1:], [], [context])
    return torch.tensor([11]), torch.tensor([3]), meta


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, num_blocks=4, linear_kernel="int4")
    model, caches = engine.model, engine.kv_cache.layers
    num_slots = caches[0][0].shape[0]
    before = [t.clone() for cache in caches for t in cache]
    for slot in (num_slots, -1, 10**12):
        ids, positions, meta = _decode_inputs(engine, slot)
        with pytest.raises(EngineError, match="outside the cache"):
            model(ids, positions, caches, meta)
    assert all(torch.equal(a, b) for a, b in zip((t for cache in caches for t in cache), before))
    ids, positions, meta = _decode_inputs(engine, num_slots - 1)
    assert model(ids, positions, caches, meta).shape == (1, model.config.hidden_size)


def test_slots_and_caches_it_cannot_read_run_the_modules(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, num_blocks=4, linear_kernel="int4")
    model, compiled = engine.model, engine.model.compiled_decode
    assert compiled is not None
    ids, positions, meta = _decode_inputs(engine, 5)
    x = model.embed_tokens(ids)
    cos, sin = torch.ones(1, 16), torch.zeros(1, 16)
    caches = engine.kv_cache.layers
    assert compiled.forward(x, cos, sin, caches, meta) is not None
    narrow = AttentionMetadata.build(meta.slot_mapping.int(), [], [torch.tensor([0, 1, 2, 5])])
    assert compiled.forward(x, cos, sin, caches, narrow) is None  # int32 slots: not the library's layout
    half = [(k.half(), v.half()) for k, v in caches]
    assert compiled.forward(x, cos, sin, half, meta) is None
    assert compiled.forward(x, cos, sin, caches[:1], meta) is None  # fewer caches than layers
    assert compiled.forward(x, cos, sin, caches, meta) is not None  # and back to the engine's own
