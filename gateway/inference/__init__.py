"""Multi-agent structure inferred from unmodified traffic, and the SegmentPlan it yields."""

from __future__ import annotations

from gateway.inference.planner import Inference, PlanResult

__all__ = ["Inference", "PlanResult"]
