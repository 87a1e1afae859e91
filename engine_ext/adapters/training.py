"""Training a LoRA adapter: conventionally, or as an ICaRus logical decoder.

A differentiable forward over one sequence, on the serving model's (frozen) weights
plus trainable LoRA factors. `lora`: the adapted model attends to its own keys and
values. `icarus`: the frozen base (the logical encoder) computes every layer's keys and
values, and the adapted model (the logical decoder) attends to those, never to its own;
so at serving time its predictions read the one cache every ICaRus adapter shares. The
trained factors are written in PEFT's format (adapter_config.json +
adapter_model.safetensors), which `load_lora` reads back, with the mode they were
trained in marked in the safetensors header (engine_ext/adapters/marks.py): only an
`icarus`-trained adapter is served in icarus mode by default.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from engine_ext.adapters.lora import MODULES, PEFT_PARENTS, module_rows
from engine_ext.adapters.marks import WEIGHTS_FILE, TrainedAs, training_metadata
from engine_ext.model import CausalLM
from engine_ext.model.llama import DecoderLayer
from engine_ext.kernels.rope import apply_rotary, rope_cos_sin

TrainMode = TrainedAs  # lora | icarus: how the factors are fitted, and the mark they are saved with


class LoraFactors(torch.nn.Module):
    """Trainable A (r, in) and B (out, r) per layer and PEFT module; B starts at zero.

    `trained_as` is how they are (or, for factors a test or benchmark sets by hand, stand
    for factors) trained; `save` marks the adapter with it, so the engine knows whether
    icarus mode serves the model they are. None: saved as a plain, unmarked PEFT LoRA."""

    def __init__(self, model: CausalLM, rank: int, alpha: float, modules: tuple[str, ...], seed: int = 0,
                 trained_as: TrainMode | None = None) -> None:
        super().__init__()
        cfg = model.config
        self.rank, self.alpha, self.modules_ = rank, alpha, modules
        self.trained_as = trained_as
        self.scaling = alpha / rank
        rows = module_rows(cfg)
        gen = torch.Generator().manual_seed(seed)
        self.a = torch.nn.ParameterDict()
        self.b = torch.nn.ParameterDict()
        for layer in range(cfg.num_layers):
            for module in modules:
                fused = _projection(model, layer, MODULES[module][0])
                start, end = rows[module]
                in_features = fused.weight.shape[1]
                key = f"{layer}_{module}"
                self.a[key] = torch.nn.Parameter(torch.randn((rank, in_features), generator=gen) / in_features**0.5)
                self.b[key] = torch.nn.Parameter(torch.zeros((end - start, rank)))

    def project(self, model: CausalLM, layer: int, fused_name: str, x: torch.Tensor) -> torch.Tensor:
        """The fused projection's output for x (T, in), with this adapter's updates."""
        fused = _projection(model, layer, fused_name)
        out = F.linear(x, fused.weight, fused.bias)  # (T, out)
        parts = []
        rows = module_rows(model.config)
        for module in self.modules_:
            if MODULES[module][0] == fused_name:
                start, end = rows[module]
                key = f"{layer}_{module}"
                delta = (x @ self.a[key].T) @ self.b[key].T * self.scaling  # (T, end - start)
                parts.append((start, end, delta))
        if not parts:
            return out
        pieces, cursor = [], 0
        for start, end, delta in sorted(parts, key=lambda p: p[0]):
            pieces += [out[:, cursor:start], out[:, start:end] + delta]
            cursor = end
        pieces.append(out[:, cursor:])
        return torch.cat(pieces, dim=1)

    def save(self, path: Path) -> None:
        """Write the factors as a PEFT LoRA adapter, marked with `trained_as`."""
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for key in self.a:
            layer, module = key.split("_", 1)
            name = f"base_model.model.model.layers.{layer}.{PEFT_PARENTS[module]}.{module}"
            tensors[f"{name}.lora_A.weight"] = self.a[key].detach().contiguous()
            tensors[f"{name}.lora_B.weight"] = self.b[key].detach().contiguous()
        save_file(tensors, str(path / WEIGHTS_FILE), metadata=training_metadata(self.trained_as))
        config = {"peft_type": "LORA", "r": self.rank, "lora_alpha": self.alpha, "target_modules": list(self.modules_),
                  "bias": "none", "task_type": "CAUSAL_LM"}
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


def forward_logits(model: CausalLM, factors: LoraFactors | None, token_ids: torch.Tensor,
                   mode: TrainMode) -> torch.Tensor:
    """Logits (T, vocab) for one sequence; the base's weights are never updated."""
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(token_ids.shape[0]))  # each (T, rotary_dim)
    x = model.embed_tokens.weight[token_ids]  # (T, hidden)
    base = x if mode == "icarus" else None
    for layer_index, layer in enumerate(model.layers):
        shared_kv = None
        if base is not None:  # the logical encoder's keys and values, and its next hidden state
            with torch.no_grad():
                shared_kv, base = _layer(model, None, layer_index, base, cos, sin, None)
        _, x = _layer(model, factors, layer_index, x, cos, sin, shared_kv)
    return F.linear(model.norm(x), model.lm_head.weight).float()  # (T, vocab)


def _layer(model: CausalLM, factors: LoraFactors | None, index: int, x: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, shared_kv: tuple[torch.Tensor, torch.Tensor] | None
           ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One decoder layer: ((K, V) it computed, output hidden (T, hidden)). With
    `shared_kv`, attention reads those keys and values instead of its own."""
    cfg = model.config
    layer = _decoder(model, index)

    def project(name: str, h: torch.Tensor) -> torch.Tensor:
        if factors is not None:
            return factors.project(model, index, name, h)
        linear = _projection(model, index, name)
        return F.linear(h, linear.weight, linear.bias)

    h = layer.input_layernorm(x)
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = torch.split(project("self_attn.qkv_proj", h), [q_size, kv_size, kv_size], dim=-1)
    num_tokens = x.shape[0]
    q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)  # (T, heads, D)
    k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # (T, kv_heads, D)
    v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    attn = layer.self_attn
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    keys, values = shared_kv if shared_kv is not None else (k, v)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                       values.transpose(0, 1)[None], is_causal=True, scale=attn.scale,
                                       enable_gqa=True)[0].transpose(0, 1)  # (T, heads, D)
    x = x + project("self_attn.o_proj", o.reshape(num_tokens, q_size))
    h = layer.post_attention_layernorm(x)
    gate, up = project("mlp.gate_up_proj", h).chunk(2, dim=-1)  # each (T, intermediate)
    x = x + project("mlp.down_proj", F.silu(gate) * up)
    return (k, v), x


def _decoder(model: CausalLM, index: int) -> DecoderLayer:
    """Decoder layer `index`, as its type: nn.ModuleList hands out plain Modules."""
    layer = model.layers[index]
    assert isinstance(layer, DecoderLayer)  # CausalLM builds every layer as one
    return layer


def _projection(model: CausalLM, index: int, name: str) -> nn.Linear:
    """Layer `index`'s fused projection `name` (e.g. "self_attn.qkv_proj"), as its type:
    get_submodule hands out a plain Module."""
    linear = _decoder(model, index).get_submodule(name)
    assert isinstance(linear, nn.Linear)  # every fused projection is a PackedLinear
    return linear


def completion_loss(model: CausalLM, factors: LoraFactors, prompt: list[int], completion: list[int],
                    mode: TrainMode) -> torch.Tensor:
    """Mean cross-entropy of the completion's tokens given everything before them."""
    tokens = torch.tensor(prompt + completion)
    logits = forward_logits(model, factors, tokens[:-1], mode)  # (T - 1, vocab)
    return F.cross_entropy(logits[len(prompt) - 1 :], tokens[len(prompt) :])


def train(model: CausalLM, examples: list[tuple[list[int], list[int]]], mode: TrainMode, *, rank: int = 8,
          alpha: float = 16.0, modules: tuple[str, ...] = tuple(MODULES), steps: int = 20, lr: float = 1e-3,
          seed: int = 0) -> tuple[LoraFactors, list[float]]:
    """Fit LoRA factors to (prompt, completion) examples with the base frozen; returns
    the factors and the mean loss of each pass over the examples."""
    for param in model.parameters():
        param.requires_grad_(False)
    factors = LoraFactors(model, rank, alpha, modules, seed, trained_as=mode)
    optimizer = torch.optim.AdamW(factors.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        total = 0.0
        for prompt, completion in examples:
            loss = completion_loss(model, factors, prompt, completion, mode)
            optimizer.zero_grad()
            torch.autograd.backward(loss)  # loss.backward(), whose torch signature is unannotated
            optimizer.step()
            total += float(loss.detach())
        losses.append(total / len(examples))
    return factors, losses
