"""SQL storage for the gateway's records."""

from __future__ import annotations

from kvrelay.gateway.storage.models import AgentRow, Base, RequestRow, SessionRow
from kvrelay.gateway.storage.writer import RecordWriter, RequestRecord

__all__ = ["AgentRow", "Base", "RecordWriter", "RequestRecord", "RequestRow", "SessionRow"]
