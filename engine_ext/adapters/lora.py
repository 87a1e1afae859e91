"""LoRA adapters in PEFT's format, laid onto the engine's fused projections.

A PEFT LoRA adapter is a directory with `adapter_config.json` (r, lora_alpha,
target_modules, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`:
A is (r, in_features), B is (out_features, r), and the adapted projection computes
W x + scaling * B (A x), scaling = lora_alpha / r (or / sqrt(r) with rsLoRA).

The engine fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an
adapter's modules are grouped per fused projection, each with the rows of the fused
output it adds to. Only what the engine can apply exactly is accepted: plain LoRA on
the seven Llama projections, no bias, no DoRA, no fan-in-fan-out layout; anything else
is refused with a message naming it, never approximated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine_ext.config import ModelConfig
from engine_ext.errors import ModelLoadError

# PEFT module name -> (the engine's fused projection, its part index within it)
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
PEFT_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoraPart(NamedTuple):
    """One PEFT module's update, as rows [start, end) of a fused projection's output."""

    start: int
    end: int
    a: torch.Tensor  # (r, in_features)
    b: torch.Tensor  # (end - start, r), already multiplied by the scaling


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    parts: dict[tuple[int, str], tuple[LoraPart, ...]]  # (layer, fused projection) -> its parts
    widths: dict[str, int]  # fused projection -> its output features

    def delta(self, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor | None:
        """What the adapter adds to `projection`'s output for inputs x (N, in), as
        (N, out); None when it does not adapt that projection in that layer."""
        parts = self.parts.get((layer, projection))
        if parts is None:
            return None
        out = x.new_zeros((x.shape[0], self.widths[projection]))  # (N, out)
        for part in parts:
            out[:, part.start : part.end] += (x @ part.a.T) @ part.b.T  # (N, r) @ (r, rows)
        return out


def module_rows(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Where each PEFT module's output lands inside its fused projection."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv), "o_proj": (0, cfg.hidden_size),
            "gate_proj": (0, inter), "up_proj": (inter, 2 * inter), "down_proj": (0, cfg.hidden_size)}


def _in_features(cfg: ModelConfig, module: str) -> int:
    if module == "o_proj":
        return cfg.num_heads * cfg.head_dim
    if module == "down_proj":
        return cfg.intermediate_size
    return cfg.hidden_size


def load_lora(adapter_dir: Path, cfg: ModelConfig, name: str, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter for a base model with config `cfg`."""
    adapter_dir = Path(adapter_dir)
    settings = _read_settings(adapter_dir)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ModelLoadError(f"adapter {name!r}: r must be a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ModelLoadError(f"adapter {name!r}: lora_alpha must be a number")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ModelLoadError(f"adapter {name!r}: cannot read adapter_model.safetensors: {exc}") from exc
    rows = module_rows(cfg)
    grouped: dict[tuple[int, str], list[LoraPart]] = {}
    for key in sorted(k for k in tensors if k.endswith("lora_A.weight")):
        layer, module = _parse_key(key, name, cfg.num_layers)
        a = tensors.pop(key)
        b = tensors.pop(key.replace("lora_A", "lora_B"), None)
        start, end = rows[module]
        if b is None or a.shape != (rank, _in_features(cfg, module)) or b.shape != (end - start, rank):
            raise ModelLoadError(f"adapter {name!r}: {key} and its lora_B do not fit the base model "
                                 f"(expected A {(rank, _in_features(cfg, module))}, B {(end - start, rank)})")
        projection = MODULES[module][0]
        part = LoraPart(start, end, a.to(dtype), (b * scaling).to(dtype))
        grouped.setdefault((layer, projection), []).append(part)
    if tensors:
        raise ModelLoadError(f"adapter {name!r} has tensors the engine cannot apply: {sorted(tensors)[:3]}")
    if not grouped:
        raise ModelLoadError(f"adapter {name!r} adapts nothing")
    parts = {key: tuple(sorted(group, key=lambda p: p.start)) for key, group in grouped.items()}
    widths = {"self_attn.qkv_proj": rows["v_proj"][1], "self_attn.o_proj": cfg.hidden_size,
              "mlp.gate_up_proj": rows["up_proj"][1], "mlp.down_proj": cfg.hidden_size}
    return LoraAdapter(name, rank, scaling, parts, widths)


def _read_settings(adapter_dir: Path) -> dict[str, object]:
    path = adapter_dir / "adapter_config.json"
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{adapter_dir} has no adapter_config.json") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    refusals = {
        "peft_type": (settings.get("peft_type", "LORA") != "LORA", "only LoRA adapters are supported"),
        "bias": (settings.get("bias", "none") != "none", "LoRA bias terms are not supported"),
        "use_dora": (bool(settings.get("use_dora")), "DoRA is not supported"),
        "fan_in_fan_out": (bool(settings.get("fan_in_fan_out")), "fan_in_fan_out layouts are not supported"),
        "modules_to_save": (bool(settings.get("modules_to_save")), "fully trained modules are not supported"),
        # Per-module ranks or alphas would scale some modules wrongly: refuse, never approximate.
        "rank_pattern": (bool(settings.get("rank_pattern")), "per-module ranks are not supported"),
        "alpha_pattern": (bool(settings.get("alpha_pattern")), "per-module alphas are not supported"),
    }
    for field, (refused, reason) in refusals.items():
        if refused:
            raise ModelLoadError(f"{path}: {field}: {reason}")
    return settings


def _parse_key(key: str, name: str, num_layers: int) -> tuple[int, str]:
    """(layer, PEFT module) of `...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`."""
    parts = key.split(".")
    try:
        at = parts.index("layers")
        layer, parent, module = int(parts[at + 1]), parts[at + 2], parts[at + 3]
    except (ValueError, IndexError) as exc:
        raise ModelLoadError(f"adapter {name!r}: unexpected tensor name {key!r}") from exc
    if module not in MODULES or PEFT_PARENTS[module] != parent or not 0 <= layer < num_layers:
        raise ModelLoadError(f"adapter {name!r}: {key!r} names no projection of the base model")
    return layer, module
