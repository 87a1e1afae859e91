"""A compact Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Projections are fused (qkv, gate_up) so each layer runs two large matmuls instead of five;
the loader concatenates the HF weights accordingly, then packs them for oneDNN (linear.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_ext.adapters.rows import AdapterRows
from engine_ext.config import ModelConfig
from engine_ext.model.attention import AttentionMetadata, paged_attention
from engine_ext.model.decode_forward import CompiledDecode
from engine_ext.model.linear import PackedLinear
from engine_ext.kernels.norm import rms_norm
from engine_ext.kernels.rope import apply_rotary, rope_cos_sin, rope_inv_freq
from engine_ext.kernels.swiglu import swiglu

LayerCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each (num_slots, kv_heads, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One pass on the compiled kernel where it runs (inference), else torch's fused op.
            compiled = rms_norm(x, self.weight, self.eps)
            return compiled if compiled is not None else F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = PackedLinear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
        adapters: AdapterRows | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (N, q_size + 2 * kv_size)
        if adapters is not None:
            adapters.add(qkv, self.layer, "self_attn.qkv_proj", x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)  # (N, heads + kv_heads, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (N, kv_heads, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k rotate by the same angles: one rotation over both, heads side by side.
        q, k = torch.split(apply_rotary(qk, cos, sin), [self.num_heads, self.num_kv_heads], dim=1)
        k_cache, v_cache = cache
        num_kv = meta.num_kv_rows  # ICaRus decoder rows (after these) write no K/V
        k_cache.index_copy_(0, meta.slot_mapping, k[:num_kv])
        v_cache.index_copy_(0, meta.slot_mapping, v[:num_kv])
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # (N, heads, D)
        out = out.reshape(num_tokens, self.q_size)
        projected = self.o_proj(out)  # (N, hidden)
        return projected if adapters is None else adapters.add(projected, self.layer, "self_attn.o_proj", out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up_proj = PackedLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = PackedLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, adapters: AdapterRows | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (N, 2 * intermediate)
        if adapters is not None:
            adapters.add(gate_up, self.layer, "mlp.gate_up_proj", x)
        hidden = swiglu(gate_up)  # (N, intermediate), one pass where the compiled kernel runs
        if hidden is None:
            gate, up = gate_up.chunk(2, dim=-1)  # each (N, intermediate)
            hidden = nn.functional.silu(gate) * up
        out = self.down_proj(hidden)  # (N, hidden)
        return out if adapters is None else adapters.add(out, self.layer, "mlp.down_proj", hidden)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
                meta: AttentionMetadata, adapters: AdapterRows | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, adapters)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(x), adapters)  # nn.Module calls are Any
        return x + mlp_out


class StepInterrupted(Exception):
    """A forward stopped between layers because its `interrupt` said so: its rows' KV is
    partly written (the layers before the stop) and must be computed again."""


class CausalLM(nn.Module):
    """Token ids and positions in, final hidden states out; logits on demand for chosen rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = PackedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # A plain attribute, not a buffer: `model.to(bfloat16)` must not touch the fp32 frequencies.
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.rotary_dim)  # (rotary_dim/2,)
        # Set by the loader once the weights are final: plain decode batches then run their
        # layers in one compiled call (bitwise this module's result); None keeps the modules.
        self.compiled_decode: CompiledDecode | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerCache],
        meta: AttentionMetadata,
        adapters: AdapterRows | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: (N,) flat over the batch. Returns hidden states (N, hidden).
        `adapters` adds LoRA updates to the rows it names (multi-LoRA). `interrupt`,
        asked before every layer but the first, stops the pass (StepInterrupted) when it
        returns True: background work gives way to a request within one layer."""
        cos, sin = rope_cos_sin(self.inv_freq, positions)  # each (N, rotary_dim)
        x = self.embed_tokens(input_ids)  # (N, hidden)
        compiled = self.compiled_decode
        if compiled is not None and adapters is None and interrupt is None and compiled.applies(x.shape[0], meta):
            out = compiled.forward(x, cos, sin, kv_caches, meta)
            if out is not None:
                return out
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if i and interrupt is not None and interrupt():
                raise StepInterrupted(f"stopped before layer {i}")
            x = layer(x, cos, sin, cache, meta, adapters)
        hidden: torch.Tensor = self.norm(x)  # (N, hidden); nn.Module calls are typed Any
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)  # (n, vocab); nn.Module calls are typed Any
        return logits.to(torch.float32)
