"""PagedKV: token ranges of one request's K and V in vLLM's paged cache, as plain tensors.

Copying whole blocks (BlockCopier) needs no knowledge of what is inside a block; placing
a segment at a new position and computing around it does: the keys must be rotated and
the model must read them. Two layouts are known:

- vLLM's CPU backend (fp32, its `vec` kernels): per layer (num_blocks, kv_heads,
  block_size, 2 * head_dim); within a block and head, the keys transposed, (head_dim,
  block_size), then the values, (block_size, head_dim).
- vLLM's GPU backends (FlashAttention and kin): per layer (2, num_blocks, block_size,
  kv_heads, head_dim).

A layout is an assumption about code kvrelay does not own, so it is checked before any
KV is trusted: `ModelBridge.check_layout` (engine_ext/vllm/bridge.py) compares layer 0's
keys and values read through this class with the model's own for the same tokens
(layer 0 depends on nothing but the tokens and their positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Layout = Literal["cpu", "gpu"]


class PagedKV:
    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int, num_kv_heads: int, head_dim: int) -> None:
        self.layers = list(layers)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = tuple(self.layers[0].shape)
        if len(shape) == 4 and shape[0] == num_blocks and shape[1] == num_kv_heads and shape[3] == 2 * head_dim:
            self.layout: Layout = "cpu"
            self.block_size = shape[2]
        elif len(shape) == 5 and shape[:2] == (2, num_blocks) and shape[3:] == (num_kv_heads, head_dim):
            self.layout = "gpu"
            self.block_size = shape[2]
        else:
            raise ValueError(f"kvrelay connector: unknown KV cache layout {shape} "
                             f"({num_blocks} blocks, {num_kv_heads} KV heads of {head_dim})")

    def read(self, layer: int, block_ids: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end), each (end - start, kv_heads, head_dim)."""
        blocks = self._blocks(block_ids, start, end)
        if self.layout == "cpu":
            raw = self.layers[layer][blocks]  # (n, H, bs, 2D): keys (D, bs) then values (bs, D), flat
            flat = raw.reshape(len(blocks), self.num_kv_heads, 2, -1)
            keys = flat[:, :, 0].reshape(len(blocks), self.num_kv_heads, self.head_dim, self.block_size)
            values = flat[:, :, 1].reshape(len(blocks), self.num_kv_heads, self.block_size, self.head_dim)
            k = keys.permute(0, 3, 1, 2).reshape(-1, self.num_kv_heads, self.head_dim)  # (n * bs, H, D)
            v = values.permute(0, 2, 1, 3).reshape(-1, self.num_kv_heads, self.head_dim)
        else:
            k = self.layers[layer][0, blocks].reshape(-1, self.num_kv_heads, self.head_dim)
            v = self.layers[layer][1, blocks].reshape(-1, self.num_kv_heads, self.head_dim)
        offset = start - (start // self.block_size) * self.block_size
        return k[offset : offset + end - start], v[offset : offset + end - start]

    def write(self, layer: int, block_ids: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (each (T, kv_heads, head_dim)) at positions [start, start + T)."""
        end = start + k.shape[0]
        blocks = self._blocks(block_ids, start, end)
        first = (start // self.block_size) * self.block_size
        cur_k, cur_v = self.read(layer, block_ids, first, first + len(blocks) * self.block_size)
        cur_k = cur_k.clone()
        cur_v = cur_v.clone()
        cur_k[start - first : end - first] = k
        cur_v[start - first : end - first] = v
        n, bs, heads, dim = len(blocks), self.block_size, self.num_kv_heads, self.head_dim
        if self.layout == "cpu":
            keys = cur_k.reshape(n, bs, heads, dim).permute(0, 2, 3, 1).reshape(n, heads, bs * dim)
            values = cur_v.reshape(n, bs, heads, dim).permute(0, 2, 1, 3).reshape(n, heads, bs * dim)
            self.layers[layer][blocks] = torch.cat((keys, values), dim=-1).reshape(n, heads, bs, 2 * dim)
        else:
            self.layers[layer][0, blocks] = cur_k.reshape(n, bs, heads, dim)
            self.layers[layer][1, blocks] = cur_v.reshape(n, bs, heads, dim)

    def _blocks(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        if not 0 <= start < end or end > len(block_ids) * self.block_size:
            raise ValueError(f"positions [{start}, {end}) are not within {len(block_ids)} blocks")
        first, last = start // self.block_size, (end - 1) // self.block_size
        return torch.tensor(list(block_ids[first : last + 1]), dtype=torch.long)
