"""The gateway's web page at /ui: live and recent sessions; for one session its agents
and step graph, its rounds, and a TTFT waterfall of its requests (kvrelay/gateway/ui/router.py)."""

from __future__ import annotations

from kvrelay.gateway.ui.router import install_ui

__all__ = ["install_ui"]
