"""kvrelay: serve multi-agent LLM applications fast by reusing KV caches across agents."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
