"""AdapterRegistry: the adapters an engine serves, loaded once, looked up per request."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from engine_ext.adapters.lora import LoraAdapter, load_lora
from engine_ext.adapters.marks import ServedMode, TrainedAs, read_trained_as, resolve_mode, resolved
from engine_ext.config import AdapterSpec, ModelConfig
from engine_ext.errors import InvalidRequestError
from engine_ext.kv.hashing import namespace_root

logger = logging.getLogger(__name__)


class ServedAdapter(NamedTuple):
    spec: AdapterSpec  # as configured, except that `mode` is the one it runs in (never `auto`)
    lora: LoraAdapter
    hash_root: bytes | None  # the prefix cache namespace of its K/V; None: the base model's (icarus)
    trained_as: TrainedAs | None = None  # its `kvrelay train` mark; None: a plain PEFT adapter

    @property
    def mode(self) -> ServedMode:
        """The mode it is served in, `auto` resolved (engine_ext/adapters/marks.py)."""
        return "icarus" if self.spec.mode == "icarus" else "multi_lora"

    @property
    def is_icarus(self) -> bool:
        return self.mode == "icarus"


class AdapterRegistry:
    def __init__(self, specs: tuple[AdapterSpec, ...], cfg: ModelConfig, model_name: str, dtype: torch.dtype) -> None:
        self.adapters: dict[str, ServedAdapter] = {}
        for spec in specs:
            lora = load_lora(Path(spec.path), cfg, spec.name, dtype)
            trained_as = read_trained_as(Path(spec.path), spec.name)
            mode = resolve_mode(spec, trained_as)
            root = None if mode == "icarus" else namespace_root(f"{model_name}:lora:{spec.name}")
            self.adapters[spec.name] = ServedAdapter(resolved(spec, mode), lora, root, trained_as)
            logger.info("adapter %r: %s mode (asked %s; %s)", spec.name, mode, spec.mode,
                        f"trained as {trained_as} by kvrelay train" if trained_as else "no kvrelay training mark")

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def modes(self) -> dict[str, ServedMode]:
        """Each adapter's effective mode, for whatever reports how adapters are served."""
        return {name: adapter.mode for name, adapter in self.adapters.items()}

    def get(self, name: str) -> ServedAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            served = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequestError(f"unknown adapter {name!r} (served: {served})", param="model")
        return adapter
