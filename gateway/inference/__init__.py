"""Multi-agent structure inferred from unmodified traffic, and the SegmentPlan it yields."""

from __future__ import annotations

from gateway.inference.hold import RoundHold
from gateway.inference.planner import Inference, PlanResult
from gateway.inference.store import LoadResult, StateStore

__all__ = ["Inference", "LoadResult", "PlanResult", "RoundHold", "StateStore"]
