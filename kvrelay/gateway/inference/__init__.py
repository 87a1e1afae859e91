"""Multi-agent structure inferred from unmodified traffic, and the SegmentPlan it yields."""

from __future__ import annotations

from kvrelay.gateway.inference.hold import RoundHold
from kvrelay.gateway.inference.planner import Inference, PlanResult
from kvrelay.gateway.inference.store import LoadResult, StateStore

__all__ = ["Inference", "LoadResult", "PlanResult", "RoundHold", "StateStore"]
