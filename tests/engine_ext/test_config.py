from __future__ import annotations

import pytest

from engine_ext.config import EngineConfig, ModelConfig, RopeConfig
from engine_ext.errors import ModelLoadError
from engine_ext.kv.cache import KVCache

RAW = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 5e5, "eos_token_id": [7, 8]}


def test_model_config_from_hf_defaults_and_fields():
    cfg = ModelConfig.from_hf(RAW)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.eos_token_ids == (7, 8)
    assert cfg.rope.theta == 5e5 and cfg.rope.rope_type == "default"
    assert cfg.rotary_dim == 16
    assert not cfg.tie_word_embeddings and not cfg.qkv_bias and not cfg.qk_norm
    no_kv = ModelConfig.from_hf({k: v for k, v in RAW.items() if k != "num_key_value_heads"})
    assert no_kv.num_kv_heads == 4
    assert ModelConfig.from_hf({**RAW, "eos_token_id": None}).eos_token_ids == ()
    assert ModelConfig.from_hf({**RAW, "eos_token_id": 3}).eos_token_ids == (3,)
    assert ModelConfig.from_hf({**RAW, "head_dim": 32}).head_dim == 32
    assert ModelConfig.from_hf({**RAW, "model_type": "qwen2"}).qkv_bias
    assert ModelConfig.from_hf({**RAW, "model_type": "qwen3"}).qk_norm


def test_transformers5_rope_parameters_are_read():
    raw = {k: v for k, v in RAW.items() if k != "rope_theta"}
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 2.0, 1234.0)


@pytest.mark.parametrize("change", [
    {"model_type": "gpt2"},
    {"num_key_value_heads": 3},
    {"vocab_size": 0},
    {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    {"rope_theta": -1.0},
])
def test_model_config_refusals(change):
    with pytest.raises(ModelLoadError):
        ModelConfig.from_hf({**RAW, **change})


def test_model_config_from_dir_missing_field(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in RAW.items() if k != "hidden_size"}))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("kwargs", [
    {"kv_cache_bytes": 0}, {"block_size": 0}, {"block_size": 2048}, {"max_num_seqs": 0},
    {"max_num_batched_tokens": 0}, {"max_model_len": 1}, {"dtype": "float64"},
])
def test_engine_config_refusals(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_kv_cache_sizing():
    cfg = ModelConfig.from_hf(RAW)
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    cache = KVCache(cfg, EngineConfig(kv_cache_bytes=10 * per_block + per_block - 1))
    assert cache.bytes_per_block == per_block
    assert cache.num_blocks == 10
    assert cache.num_tokens == 160
    assert len(cache.layers) == 2
    assert cache.layers[0][0].shape == (160, 2, 16)
    half = KVCache(cfg, EngineConfig(kv_cache_bytes=10 * per_block, dtype="bfloat16"))
    assert half.num_blocks == 20
    with pytest.raises(ModelLoadError):
        KVCache(cfg, EngineConfig(kv_cache_bytes=per_block))


def test_rope_config_partial_factor_from_hf():
    cfg = ModelConfig.from_hf({**RAW, "partial_rotary_factor": 0.5})
    assert cfg.rotary_dim == 8
    assert RopeConfig.from_hf({}).theta == 10000.0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"policy": "fifo"}, r"policy\n  Input should be 'lru' or 'workflow'"),
    ({"host_bytes": -1}, r"host_bytes\n  Input should be greater than or equal to 0"),
    ({"disk_path": "/tmp/kv"}, "needs both"),
    ({"disk_bytes": 2**20}, "needs both"),
    ({"load_ahead": 2, "host_bytes": 2**20, "policy": "lru"}, "needs the workflow policy"),
    ({"load_ahead": 2, "policy": "workflow", "host_bytes": 0}, "needs a host or disk tier"),
    ({"load_ahead": 65, "policy": "workflow", "host_bytes": 2**20}, "load_ahead"),
    ({"max_prefetches": 0}, "max_prefetches"),
    ({"max_load_wait_ms": -1.0}, "max_load_wait_ms"),
    ({"workflow_idle_s": 0.0}, "workflow_idle_s"),
    ({"workflow_max_sessions": 0}, "workflow_max_sessions"),
])
def test_tier_config_refusals(kwargs, message):
    from engine_ext.config import TierConfig

    with pytest.raises(ValueError, match=message):
        TierConfig(**kwargs)


def test_a_tier_too_small_for_one_block_is_refused(tiny_model_dir):
    from engine_ext.config import TierConfig
    from engine_ext.errors import ModelLoadError
    from tests.helpers import make_engine

    with pytest.raises(ModelLoadError, match="host tier's budget holds no block"):
        make_engine(tiny_model_dir("llama"), tiers=TierConfig(host_bytes=100))
