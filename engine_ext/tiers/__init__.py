"""KVFlow: tiered KV storage, workflow-aware eviction, prefetch of the agents due next."""

from __future__ import annotations

from engine_ext.tiers.policy import WorkflowPolicy
from engine_ext.tiers.prefetch import Prefetcher
from engine_ext.tiers.sessions import SessionKey, WorkflowSessions
from engine_ext.tiers.sizing import with_sized_host_tier
from engine_ext.tiers.store import LowerMatch, NodeState, TieredStore, TierEntry, TierStats
from engine_ext.tiers.workflow import AgentKey, UpcomingAgent, WorkflowTable

__all__ = [
    "AgentKey", "LowerMatch", "NodeState", "Prefetcher", "SessionKey", "TierEntry", "TierStats", "TieredStore",
    "UpcomingAgent", "WorkflowPolicy", "WorkflowSessions", "WorkflowTable", "with_sized_host_tier",
]
