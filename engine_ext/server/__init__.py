"""The embedded engine's OpenAI-compatible HTTP server."""

from __future__ import annotations

from engine_ext.server.app import create_app

__all__ = ["create_app"]
