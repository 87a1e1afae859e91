"""kvrelay's OpenAI-compatible gateway: proxy, records, metrics, in front of any engine."""

from __future__ import annotations

from kvrelay.gateway.app import create_app
from kvrelay.gateway.settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app"]
