"""PEFT LoRA adapters laid onto the fused projections: exact deltas, clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_ext.adapters import load_lora
from engine_ext.config import ModelConfig
from engine_ext.errors import ModelLoadError

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=128,
                  tie_word_embeddings=False, qkv_bias=False, qk_norm=False)
SHAPES = {"q_proj": (32, 32), "k_proj": (16, 32), "v_proj": (16, 32), "o_proj": (32, 32),
          "gate_proj": (48, 32), "up_proj": (48, 32), "down_proj": (32, 48)}  # (out, in)
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _key(layer: int, module: str, ab: str) -> str:
    return f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}.lora_{ab}.weight"


def write_adapter(path: Path, modules=tuple(SHAPES), rank: int = 4, alpha: float = 8.0, seed: int = 0,
                  **settings) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(CFG.num_layers):
        for module in modules:
            out_f, in_f = SHAPES[module]
            tensors[_key(layer, module, "A")] = torch.randn((rank, in_f), generator=gen)
            tensors[_key(layer, module, "B")] = torch.randn((out_f, rank), generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps({**config, **settings}))
    return tensors


def test_fused_deltas_equal_each_module_s_update(tmp_path):
    tensors = write_adapter(tmp_path / "a")
    adapter = load_lora(tmp_path / "a", CFG, "math")
    assert adapter.rank == 4 and adapter.scaling == 2.0
    # Inputs of their own seed (the global generator's state depends on the tests run
    # before), and each update computed in the adapter's order, (x A^T) B^T: x (B A)^T
    # rounds differently in fp32 and crossed the default tolerance for some inputs.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=gen)
    for layer in range(CFG.num_layers):
        qkv = adapter.delta(layer, "self_attn.qkv_proj", x)
        expected = [2.0 * (x @ tensors[_key(layer, m, "A")].T) @ tensors[_key(layer, m, "B")].T
                    for m in ("q_proj", "k_proj", "v_proj")]
        torch.testing.assert_close(qkv, torch.cat(expected, dim=1))
        gate_up = adapter.delta(layer, "mlp.gate_up_proj", x)
        expected = [2.0 * (x @ tensors[_key(layer, m, "A")].T) @ tensors[_key(layer, m, "B")].T
                    for m in ("gate_proj", "up_proj")]
        torch.testing.assert_close(gate_up, torch.cat(expected, dim=1))
        h = torch.randn(5, 48, generator=gen)
        torch.testing.assert_close(adapter.delta(layer, "mlp.down_proj", h),
                                   2.0 * (h @ tensors[_key(layer, "down_proj", "A")].T) @ tensors[_key(layer, "down_proj", "B")].T)


def test_an_adapter_on_some_modules_leaves_the_others_alone(tmp_path):
    tensors = write_adapter(tmp_path / "a", modules=("k_proj", "down_proj"), use_rslora=True)
    adapter = load_lora(tmp_path / "a", CFG, "code")
    assert adapter.scaling == pytest.approx(8.0 / 2.0)  # rsLoRA: alpha / sqrt(r)
    x = torch.randn(3, 32)
    qkv = adapter.delta(0, "self_attn.qkv_proj", x)
    assert torch.count_nonzero(qkv[:, :32]) == 0 and torch.count_nonzero(qkv[:, 48:]) == 0
    torch.testing.assert_close(qkv[:, 32:48], 4.0 * x @ (tensors[_key(0, "k_proj", "B")] @ tensors[_key(0, "k_proj", "A")]).T)
    assert adapter.delta(0, "self_attn.o_proj", x) is None and adapter.delta(1, "mlp.gate_up_proj", x) is None


@pytest.mark.parametrize(("settings", "message"), [
    ({"peft_type": "PREFIX_TUNING"}, "only LoRA"),
    ({"bias": "all"}, "bias"),
    ({"use_dora": True}, "DoRA"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"modules_to_save": ["lm_head"]}, "fully trained modules"),
    ({"r": 0}, "r must be a positive integer"),
    ({"r": None}, "r must be a positive integer"),
    ({"lora_alpha": "8"}, "lora_alpha must be a number"),
    ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
    ({"alpha_pattern": {"q_proj": 2.0}}, "per-module alphas"),
])
def test_settings_the_engine_cannot_apply_exactly_are_refused(tmp_path, settings, message):
    write_adapter(tmp_path / "a", **settings)  # the settings override the written adapter_config.json
    with pytest.raises(ModelLoadError, match=message):
        load_lora(tmp_path / "a", CFG, "bad")


def test_tensors_that_do_not_fit_the_base_are_refused(tmp_path):
    tensors = write_adapter(tmp_path / "a")
    tensors[_key(1, "q_proj", "B")] = torch.zeros(31, 4)
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="do not fit the base model"):
        load_lora(tmp_path / "a", CFG, "bad")


@pytest.mark.parametrize("key", [
    "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight",  # no such layer
    "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",  # wrong parent
    "base_model.model.lm_head.lora_A.weight",  # not a layer projection
])
def test_tensors_naming_no_projection_are_refused(tmp_path, key):
    tensors = write_adapter(tmp_path / "a")
    tensors[key] = torch.zeros(4, 32)
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="names no projection|unexpected tensor name"):
        load_lora(tmp_path / "a", CFG, "bad")


def test_missing_files_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="no adapter_config.json"):
        load_lora(tmp_path, CFG, "none")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(ModelLoadError, match="cannot read adapter_model.safetensors"):
        load_lora(tmp_path, CFG, "none")


def test_unreadable_files_are_refused(tmp_path):
    write_adapter(tmp_path / "a")
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{trunc")
    with pytest.raises(ModelLoadError, match="cannot read adapter_model.safetensors"):
        load_lora(tmp_path / "a", CFG, "bad")
    (tmp_path / "a" / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="must hold a JSON object"):
        load_lora(tmp_path / "a", CFG, "bad")
    (tmp_path / "b" / "adapter_config.json").mkdir(parents=True)  # a directory where the file should be
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_lora(tmp_path / "b", CFG, "bad")
