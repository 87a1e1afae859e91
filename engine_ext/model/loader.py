"""Load HF safetensors checkpoints into `CausalLM`, fusing q/k/v and gate/up."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine_ext.config import ModelConfig
from kvrelay.engine_options import Dtype, LinearKernel
from engine_ext.model.dtypes import TORCH_DTYPES
from engine_ext.errors import ModelLoadError
from engine_ext.model.decode_forward import CompiledDecode
from engine_ext.model.llama import CausalLM
from engine_ext.model.linear import pack_linears
from engine_ext.model.quantize import quantize_linears

log = logging.getLogger(__name__)


def _read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
    if not files:
        raise ModelLoadError(f"{model_dir} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(str(model_dir / name)))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {model_dir / name}: {exc}") from exc
    # Some checkpoints omit the "model." prefix; normalise to the HF LlamaForCausalLM names.
    return {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in tensors.items()}


def _fused_state_dict(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        try:
            return raw.pop(name)
        except KeyError as exc:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}") from exc

    state = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        state[dst + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(attn + f"{p}_proj.weight") for p in "qkv"], dim=0
        )
        if cfg.qkv_bias:
            state[dst + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(attn + f"{p}_proj.bias") for p in "qkv"], dim=0
            )
        if cfg.qk_norm:
            state[dst + "self_attn.q_norm.weight"] = take(attn + "q_norm.weight")
            state[dst + "self_attn.k_norm.weight"] = take(attn + "k_norm.weight")
        state[dst + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
        state[dst + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")], dim=0
        )
        state[dst + "mlp.down_proj.weight"] = take(src + "mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[dst + f"{norm}.weight"] = take(src + f"{norm}.weight")
    raw.pop("lm_head.weight", None)  # tied checkpoints may still carry a copy
    unused = [k for k in raw if "rotary_emb" not in k]
    if unused:
        raise ModelLoadError(f"checkpoint has tensors this architecture does not use: {unused[:5]}")
    return state


def load_model(model_dir: Path, cfg: ModelConfig, dtype: Dtype = "float32",
               linear_kernel: LinearKernel = "auto") -> CausalLM:
    """Build the model on CPU and load its weights; shape mismatches raise ModelLoadError.
    `linear_kernel` says how the weight products run (engine_ext/model/linear.py)."""
    state = _fused_state_dict(_read_checkpoint(Path(model_dir)), cfg)
    # Build on the meta device and adopt the checkpoint tensors: no random init, no copy.
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing = expected - set(state)
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensors {sorted(missing)[:5]}")
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"weights do not match config.json: {exc}") from exc
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(TORCH_DTYPES[dtype]).eval()
    quantized = quantize_linears(model, linear_kernel)
    if quantized.layers:
        log.info("decoding on quantized blocks: %d layers, %.0f MB a step, %s, %s", quantized.layers,
                 quantized.bytes / 1e6, "exact (the weights are unchanged)" if quantized.lossless else "approximate",
                 "compiled kernel" if quantized.kernel else "no kernel here: dense path")
    pack_linears(model, "auto" if linear_kernel == "int4" else linear_kernel)
    model.compiled_decode = CompiledDecode.for_model(model)
    return model
