"""Multi-LoRA rows in the model forward: equal to running a model with the adapter merged."""

from __future__ import annotations

import copy

import torch

from engine_ext.adapters import load_lora
from engine_ext.adapters.rows import AdapterRows, AdapterSpan
from engine_ext.config import EngineConfig
from engine_ext.kv.cache import KVCache
from engine_ext.model import AttentionMetadata, CausalLM
from tests.engine_ext.adapters.test_lora import CFG, write_adapter

T = 7  # prompt tokens per sequence


def _model() -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(CFG).eval()
    for param in model.parameters():  # visible weights: RMSNorm starts at ones, the rest at small noise
        param.data.normal_(0.0, 0.2)
    return model


def _merged(model: CausalLM, adapter) -> CausalLM:
    """The model with the adapter's updates folded into its fused weights."""
    merged = copy.deepcopy(model)
    for (layer, projection), parts in adapter.parts.items():
        module = merged.layers[layer].get_submodule(projection)
        for part in parts:
            module.weight.data[part.start : part.end] += part.b @ part.a  # (rows, r) @ (r, in)
    return merged


def _prefill(model: CausalLM, prompts: list[list[int]], adapters: AdapterRows | None = None) -> torch.Tensor:
    cache = KVCache(CFG, EngineConfig(kv_cache_bytes=64 * 2 * CFG.num_layers * 16 * 2 * 8 * 4, block_size=16))
    slots = [torch.arange(i * 64, i * 64 + len(p)) for i, p in enumerate(prompts)]
    meta = AttentionMetadata.build(torch.cat(slots), [(len(p), s) for p, s in zip(prompts, slots)], [])
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    return model(ids, positions, cache.layers, meta, adapters)  # (N, hidden)


def test_adapted_rows_equal_the_merged_model_and_the_others_the_base(tmp_path):
    write_adapter(tmp_path / "math", seed=1)
    adapter = load_lora(tmp_path / "math", CFG, "math")
    model = _model()
    base_prompt, adapted_prompt = [3, 9, 4, 1, 22, 7, 5], [8, 8, 2, 30, 1, 6, 11]
    hidden = _prefill(model, [base_prompt, adapted_prompt], AdapterRows([AdapterSpan(T, 2 * T, adapter)]))
    torch.testing.assert_close(hidden[:T], _prefill(model, [base_prompt]))
    torch.testing.assert_close(hidden[T:], _prefill(_merged(model, adapter), [adapted_prompt]), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(hidden[T:], _prefill(model, [adapted_prompt]), atol=1e-3)  # the adapter matters


def test_two_adapters_in_one_batch(tmp_path):
    write_adapter(tmp_path / "a", seed=2)
    write_adapter(tmp_path / "b", modules=("q_proj", "down_proj"), seed=3)
    a, b = load_lora(tmp_path / "a", CFG, "a"), load_lora(tmp_path / "b", CFG, "b")
    model = _model()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1]]
    hidden = _prefill(model, prompts, AdapterRows([AdapterSpan(0, T, a), AdapterSpan(T, 2 * T, b)]))
    torch.testing.assert_close(hidden[:T], _prefill(_merged(model, a), prompts[:1]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[T:], _prefill(_merged(model, b), prompts[1:]), rtol=1e-4, atol=1e-4)
