"""engine_ext.rope.RopeShifter: refuses position encodings that cannot be shifted exactly,
and moves a real model's cached keys to new positions as if they had been computed there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine_ext.config import ModelConfig, RopeConfig
from engine_ext.errors import EngineError
from engine_ext.model import CausalLM, load_model
from engine_ext.rope import RopeShifter, RopeShiftError
from engine_ext.kernels.rope import apply_rotary, rope_cos_sin

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 4.0}
DELTA = 37


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "longrope"])
def test_length_dependent_rope_types_are_refused(rope_type):
    with pytest.raises(RopeShiftError, match=rope_type):
        RopeShifter.for_rope_type(rope_type)
    assert issubclass(RopeShiftError, EngineError)  # the HTTP layer maps it like any engine error


def test_for_model_checks_the_rope_type_itself(llama_dir):
    """RopeConfig refuses dynamic scaling at load time; for_model does not rely on that."""
    cfg = ModelConfig.from_dir(llama_dir)
    rope = RopeConfig()
    object.__setattr__(rope, "rope_type", "dynamic")  # bypass the frozen dataclass's validation
    with pytest.raises(RopeShiftError):
        RopeShifter.for_model(dataclasses.replace(cfg, rope=rope))


def test_delta_zero_returns_the_same_tensor(llama_dir):
    shifter = RopeShifter.for_model(ModelConfig.from_dir(llama_dir))
    keys = torch.randn(4, 2, 16)
    assert shifter.shift(keys, 0) is keys


def _layer0_keys(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Layer 0's post-RoPE keys (n, kv_heads, head_dim), computed as Attention.forward does."""
    layer = model.layers[0]
    attn = layer.self_attn
    with torch.inference_mode():
        x = layer.input_layernorm(model.embed_tokens(ids))  # (n, hidden)
        _, k, _ = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        k = k.view(len(ids), attn.num_kv_heads, attn.head_dim)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        return apply_rotary(k, *rope_cos_sin(model.inv_freq, positions))


@pytest.mark.parametrize("variant", [
    {"kind": "llama"},
    {"kind": "llama", "rope_scaling": LLAMA3},
    {"kind": "llama", "rope_scaling": LINEAR},
    {"kind": "qwen3"},  # k_norm before the rotation
], ids=["llama", "llama3_rope", "linear_rope", "qwen3"])
def test_shifted_keys_equal_keys_computed_at_the_new_positions(tiny_model_dir, variant):
    """The acceptance test of the shift: keys cached at 0..n-1 and moved by DELTA are the
    keys the model computes at DELTA..DELTA+n-1."""
    model_dir: Path = tiny_model_dir(**variant)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.rope.rope_type == (variant.get("rope_scaling") or {}).get("rope_type", "default")
    model = load_model(model_dir, cfg, "float32")
    n = 20
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(n)

    cached = _layer0_keys(model, ids, positions)
    shifter = RopeShifter.for_model(cfg)
    torch.testing.assert_close(shifter.inv_freq, model.inv_freq, rtol=0, atol=0)
    shifted = shifter.shift(cached, DELTA)
    direct = _layer0_keys(model, ids, positions + DELTA)

    assert shifted.dtype == torch.float32 and shifted.shape == direct.shape
    assert (shifted - direct).abs().max().item() <= 1e-5
    assert (cached - direct).abs().max().item() > 0.1  # the shift really moved the keys
    # a per-token tensor delta of the same value agrees with the int form
    per_token = shifter.shift(cached, torch.full((n,), DELTA, dtype=torch.long))
    assert torch.equal(per_token, shifted)
