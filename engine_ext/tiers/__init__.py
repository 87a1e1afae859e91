"""KVFlow: tiered KV storage, workflow-aware eviction, prefetch of the agents due next."""

from __future__ import annotations

from engine_ext.tiers.policy import WorkflowPolicy
from engine_ext.tiers.prefetch import Prefetcher
from engine_ext.tiers.store import LowerMatch, NodeState, TieredStore, TierEntry, TierStats
from engine_ext.tiers.workflow import AgentKey, UpcomingAgent, WorkflowTable

__all__ = [
    "AgentKey", "LowerMatch", "NodeState", "Prefetcher", "TierEntry", "TierStats", "TieredStore",
    "UpcomingAgent", "WorkflowPolicy", "WorkflowTable",
]
