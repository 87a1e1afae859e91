"""The KV tensors themselves, sized from a byte budget."""

from __future__ import annotations

import torch

from engine_ext.config import EngineConfig, ModelConfig
from engine_ext.model.dtypes import TORCH_DTYPES
from engine_ext.errors import ModelLoadError

class KVCache:
    """Per layer, K and V as (num_blocks * block_size, kv_heads, head_dim) slot tensors."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> None:
        dtype = TORCH_DTYPES[engine_cfg.dtype]
        self.block_size = engine_cfg.block_size
        self.bytes_per_block = self.block_bytes(model_cfg, engine_cfg)
        self.num_blocks = engine_cfg.kv_cache_bytes // self.bytes_per_block
        if self.num_blocks < 2:
            raise ModelLoadError(
                f"kv_cache_bytes={engine_cfg.kv_cache_bytes} holds fewer than 2 blocks of "
                f"{self.bytes_per_block} bytes; raise the KV budget"
            )
        num_slots = self.num_blocks * self.block_size
        shape = (num_slots, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(model_cfg.num_layers)
        ]

    @staticmethod
    def block_bytes(model_cfg: ModelConfig, engine_cfg: EngineConfig) -> int:
        """One block's K and V over every layer: what the budgets of every tier divide by."""
        return engine_cfg.block_size * model_cfg.kv_bytes_per_token(TORCH_DTYPES[engine_cfg.dtype].itemsize)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size
