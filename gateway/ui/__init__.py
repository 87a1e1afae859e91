"""The gateway's web page at /ui: live and recent sessions; for one session its agents
and step graph, its rounds, and a TTFT waterfall of its requests (gateway/ui/router.py)."""

from __future__ import annotations

from gateway.ui.router import install_ui

__all__ = ["install_ui"]
