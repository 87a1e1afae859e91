"""The embedded engine's model: architecture, paged attention, weight loading."""

from __future__ import annotations

from engine_ext.model.attention import AttentionMetadata, PrefillSpan, paged_attention
from engine_ext.model.llama import CausalLM, LayerCache
from engine_ext.model.loader import load_model

__all__ = ["AttentionMetadata", "CausalLM", "LayerCache", "PrefillSpan", "load_model", "paged_attention"]
