"""Task-specialised adapters on one base model (ICaRus, multi-LoRA)."""

from __future__ import annotations

from engine_ext.adapters.lora import LoraAdapter, LoraPart, load_lora

__all__ = ["LoraAdapter", "LoraPart", "load_lora"]
