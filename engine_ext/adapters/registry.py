"""AdapterRegistry: the adapters an engine serves, loaded once, looked up per request."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from engine_ext.adapters.lora import LoraAdapter, load_lora
from engine_ext.config import AdapterSpec, ModelConfig
from engine_ext.errors import InvalidRequestError
from engine_ext.kv.hashing import namespace_root


class ServedAdapter(NamedTuple):
    spec: AdapterSpec
    lora: LoraAdapter
    hash_root: bytes | None  # the prefix cache namespace of its K/V; None: the base model's (icarus)

    @property
    def is_icarus(self) -> bool:
        return self.spec.mode == "icarus"


class AdapterRegistry:
    def __init__(self, specs: tuple[AdapterSpec, ...], cfg: ModelConfig, model_name: str, dtype: torch.dtype) -> None:
        self.adapters: dict[str, ServedAdapter] = {}
        for spec in specs:
            lora = load_lora(Path(spec.path), cfg, spec.name, dtype)
            root = None if spec.mode == "icarus" else namespace_root(f"{model_name}:lora:{spec.name}")
            self.adapters[spec.name] = ServedAdapter(spec, lora, root)

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def get(self, name: str) -> ServedAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            served = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequestError(f"unknown adapter {name!r} (served: {served})", param="model")
        return adapter
